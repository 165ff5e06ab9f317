"""Launching hvdlite jobs: the `hvdlite-run` command line and the `run` Python API."""
from hvdlite.runner.api import run

__all__ = ["run"]
