"""Gradient compression for allreduce (Horovod's `hvd.Compression` for TensorFlow): the shared
compressors of `common.compression`, with TensorFlow's casts."""
from __future__ import annotations

import tensorflow as tf

from ..common import compression as _c
from ..common.compression import Compressor, NoneCompressor


class FP16Compressor(_c.CastCompressor):
    """Send floating-point tensors as float16, halving the bytes on the wire."""

    HALF = tf.float16

    @staticmethod
    def is_floating(dtype) -> bool:
        return dtype.is_floating

    @staticmethod
    def cast(tensor, dtype):
        return tf.cast(tensor, dtype=dtype)


class Compression(_c.Compression):
    """Optional gradient compression algorithm used during allreduce."""

    none = NoneCompressor
    fp16 = FP16Compressor
    # Stateful, with error feedback (see hvdlite.common.quantize / powersgd). They run on the
    # engine's torch tensors inside the gradient op, so one implementation serves both
    # frameworks. Class (defaults) or instance, e.g. Compression.powersgd(rank=2).
    int8 = None
    powersgd = None


from ..common.powersgd import PowerSGDCompressor as _PowerSGD  # noqa: E402
from ..common.quantize import Int8Compressor as _Int8  # noqa: E402

Compression.int8 = _Int8
Compression.powersgd = _PowerSGD

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor"]
