"""Data plane: one communicator per process set, behind a small interface (see base.py)."""
from .base import Communicator

__all__ = ["Communicator"]
