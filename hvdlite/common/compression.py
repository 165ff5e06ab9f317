"""Gradient compression, framework-neutral: the Compressor interface, the no-op and the fp16
compressors, and the `Compression` registry that both frontends extend.

A frontend only supplies its tensor casts (`is_floating`, `cast`, `HALF`); the logic of each
compressor is written here once.
"""
from __future__ import annotations

from typing import Any


class Compressor:
    """Interface for compressing and decompressing a given tensor (Horovod's)."""

    @staticmethod
    def compress(tensor) -> tuple[Any, Any]:
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


class CastCompressor(Compressor):
    """Send floating-point tensors as `HALF`, halving the bytes on the wire; other dtypes pass
    unchanged. Frontends set `HALF` and implement `is_floating` and `cast`."""

    HALF: Any = None

    @staticmethod
    def is_floating(dtype) -> bool:
        raise NotImplementedError

    @staticmethod
    def cast(tensor, dtype):
        raise NotImplementedError

    @classmethod
    def compress(cls, tensor):
        if cls.is_floating(tensor.dtype):
            return cls.cast(tensor, cls.HALF), tensor.dtype
        return tensor, tensor.dtype

    @classmethod
    def decompress(cls, tensor, ctx):
        if cls.is_floating(ctx):
            return cls.cast(tensor, ctx)
        return tensor


class Compression:
    """Optional gradient compression algorithm used during allreduce (frontends subclass this and
    set `fp16` to their CastCompressor)."""

    none = NoneCompressor
    fp16: type = NoneCompressor
