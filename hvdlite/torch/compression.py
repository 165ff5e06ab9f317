"""Gradient compression for allreduce (Horovod's `hvd.Compression`): the shared compressors of
`common.compression`, with torch's casts."""
from __future__ import annotations

import torch

from ..common import compression as _c
from ..common.compression import Compressor, NoneCompressor
from ..common.powersgd import PowerSGDCompressor
from ..common.quantize import Int8Compressor
from ..common.stateful_compression import StatefulCompressor, drive_all, is_stateful


class FP16Compressor(_c.CastCompressor):
    """Send floating-point tensors as float16, halving the bytes on the wire."""

    HALF = torch.float16

    @staticmethod
    def is_floating(dtype) -> bool:
        return dtype.is_floating_point

    @staticmethod
    def cast(tensor, dtype):
        return tensor.type(dtype)


class Compression(_c.Compression):
    """Optional gradient compression algorithm used during allreduce."""

    none = NoneCompressor
    fp16 = FP16Compressor
    # Stateful (per-tensor residuals/factors, their own collectives): pass the class for the
    # defaults or an instance, e.g. Compression.powersgd(rank=2). One instance per optimizer.
    int8 = Int8Compressor
    powersgd = PowerSGDCompressor


__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "Int8Compressor",
           "PowerSGDCompressor", "StatefulCompressor", "drive_all", "is_stateful"]
