"""hvdlite: Horovod-compatible distributed training for PyTorch and TensorFlow/Keras 3."""
from .common.exceptions import (HorovodInternalError, HorovodVersionMismatchError,
                                HostsUpdatedInterrupt)

__version__ = "0.1.0"

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "HorovodVersionMismatchError",
           "__version__"]
