"""Framework-independent core: engine, coordinator, transports, settings."""
from .exceptions import HorovodInternalError, HostsUpdatedInterrupt, HorovodVersionMismatchError

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "HorovodVersionMismatchError"]
