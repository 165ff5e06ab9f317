"""Gradient compression for allreduce (Horovod's `hvd.Compression` for TensorFlow)."""
from __future__ import annotations

import tensorflow as tf


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
        if tensor.dtype.is_floating:
            tensor_compressed = tf.cast(tensor, dtype=tf.float16)
        return tensor_compressed, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        dtype = ctx
        tensor_decompressed = tensor
        if dtype.is_floating:
            tensor_decompressed = tf.cast(tensor, dtype=dtype)
        return tensor_decompressed


class Compression:
    """Optional gradient compression algorithm used during allreduce."""

    none = NoneCompressor
    fp16 = FP16Compressor
    # Stateful, with error feedback (see hvdlite.torch.quantize / powersgd). They run on the
    # engine's torch tensors inside the gradient op, so one implementation serves both
    # frameworks. Class (defaults) or instance, e.g. Compression.powersgd(rank=2).
    int8 = None
    powersgd = None


from ..torch.powersgd import PowerSGDCompressor as _PowerSGD  # noqa: E402
from ..torch.quantize import Int8Compressor as _Int8  # noqa: E402

Compression.int8 = _Int8
Compression.powersgd = _PowerSGD

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor"]
