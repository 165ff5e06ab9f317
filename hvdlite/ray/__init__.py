"""hvdlite jobs on a Ray cluster: Horovod's `RayExecutor` / `ElasticRayExecutor` API and a Ray Train
backend (`HvdliteConfig`).

Ray does the scheduling, placement, node-failure detection and autoscaling; hvdlite brings its
rendezvous, engine and elastic driver. Ray is an optional dependency (`pip install hvdlite[ray]`):
nothing else in hvdlite imports it. Tested with Ray 2.60 (see `TESTED_RAY_VERSIONS`); the Ray
Train backend plug-in is a Ray developer API that may change between Ray minor releases.
"""
from __future__ import annotations

try:
    import ray as _ray  # noqa: F401
except ImportError:  # one clear line, not a traceback into Ray's absence
    raise ImportError("hvdlite.ray needs Ray, which is not installed: pip install 'hvdlite[ray]'") \
        from None

from hvdlite.ray.runner import RayExecutor, RaySettings  # noqa: E402
from hvdlite.ray.elastic import ElasticRayExecutor, RayHostDiscovery  # noqa: E402

# The Ray releases this module is tested with; others may work (the Train backend uses a
# developer API of Ray's).
TESTED_RAY_VERSIONS = ">=2.60,<2.61"


def __getattr__(name: str):
    # Ray Train is imported only when its backend is asked for: `ray.train` pulls in pandas,
    # pyarrow and more, which RayExecutor users do not need.
    if name in ("HvdliteConfig", "HvdliteBackend"):
        from hvdlite.ray import train

        return getattr(train, name)
    raise AttributeError(f"module 'hvdlite.ray' has no attribute {name!r}")


__all__ = ["RayExecutor", "RaySettings", "ElasticRayExecutor", "RayHostDiscovery",
           "HvdliteConfig", "HvdliteBackend", "TESTED_RAY_VERSIONS"]
