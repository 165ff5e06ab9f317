"""What a host update changed: shared by the elastic driver (hvdlite-run) and the workers'
elastic runtime, in a module of its own so the launcher imports it without the engine or torch."""
from __future__ import annotations

import enum


class HostUpdateResult(enum.IntFlag):
    """What changed in a host update (Horovod's values)."""

    no_update = 0
    removed = 1
    added = 2
    mixed = 3
