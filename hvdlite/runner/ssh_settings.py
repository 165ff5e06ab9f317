"""How hvdlite-run reaches remote hosts: what the local and the ssh spawners share."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class SSHSettings:
    """How to reach remote hosts (horovodrun's -p / -i)."""

    port: Optional[int] = None
    identity_file: Optional[str] = None
    connect_timeout: int = 30
