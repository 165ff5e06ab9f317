"""Gradient compression for allreduce on jax.Arrays: the shared compressors of
`common.compression`, with JAX's casts."""
from __future__ import annotations

import jax.numpy as jnp

from ..common import compression as _c
from ..common.compression import Compressor, NoneCompressor


class FP16Compressor(_c.CastCompressor):
    """Send floating-point arrays as float16, halving the bytes on the wire."""

    HALF = jnp.float16

    @staticmethod
    def is_floating(dtype) -> bool:
        return jnp.issubdtype(dtype, jnp.floating)

    @staticmethod
    def cast(tensor, dtype):
        return tensor.astype(dtype)


class Compression(_c.Compression):
    """Optional gradient compression algorithm used during allreduce."""

    none = NoneCompressor
    fp16 = FP16Compressor


__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor"]
