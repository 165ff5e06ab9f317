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


__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor"]
