"""Gradient compression for allreduce (Horovod's `hvd.Compression`)."""
from __future__ import annotations

import torch

from .powersgd import PowerSGDCompressor
from .quantize import Int8Compressor
from .stateful_compression import StatefulCompressor, drive_all, is_stateful


class Compressor:
    """Interface for compressing and decompressing a given tensor."""

    @staticmethod
    def compress(tensor):
        """Compresses a tensor and returns it with the context needed to decompress it."""

    @staticmethod
    def decompress(tensor, ctx):
        """Decompress the tensor with the given context."""


class NoneCompressor(Compressor):
    """Default: no compression."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16, halving the bytes on the wire."""

    @staticmethod
    def compress(tensor):
        tensor_compressed = tensor
        if tensor.dtype.is_floating_point:
            tensor_compressed = tensor.type(torch.float16)
        return tensor_compressed, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        dtype = ctx
        tensor_decompressed = tensor
        if dtype.is_floating_point:
            tensor_decompressed = tensor.type(dtype)
        return tensor_decompressed


class Compression:
    """Optional gradient compression algorithm used during allreduce."""

    none = NoneCompressor
    fp16 = FP16Compressor
    # Stateful (per-tensor residuals/factors, their own collectives): pass the class for the
    # defaults or an instance, e.g. Compression.powersgd(rank=2). One instance per optimizer.
    int8 = Int8Compressor
    powersgd = PowerSGDCompressor
