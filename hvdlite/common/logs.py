"""hvdlite's log set-up: module loggers under "hvdlite" that propagate to the application's.

Every module logs to `logging.getLogger(__name__)`, so an application's `logging.basicConfig`,
its handlers, and pytest's `caplog` see hvdlite's records like any other library's. hvdlite adds
its own stderr handler to the "hvdlite" logger only for an application that configured no logging
(the root logger has no handler), and that handler steps aside once the application configures
some, so no record is printed twice.

Default format (Horovod's fields: time, rank, level, where)::

    [2026-11-23 18:04:58.123] [rank 1] hvdlite WARNING hvdlite.common.stall: ...

`HOROVOD_LOG_HIDE_TIME=1` (`hvdlite-run --log-without-timestamp`) drops the time,
`HVDLITE_LOG_FORMAT=json` writes one JSON object per line, and `HOROVOD_LOG_LEVEL` sets the level.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from typing import Optional

ROOT = "hvdlite"
LEVELS = {"TRACE": logging.DEBUG, "DEBUG": logging.DEBUG, "INFO": logging.INFO,
          "WARNING": logging.WARNING, "WARN": logging.WARNING, "ERROR": logging.ERROR,
          "FATAL": logging.CRITICAL, "CRITICAL": logging.CRITICAL}

_rank: Optional[int] = None


def set_rank(rank: Optional[int]) -> None:
    """The rank shown in hvdlite's log lines (before init: the launcher's HOROVOD_RANK)."""
    global _rank
    _rank = rank


def _current_rank() -> str:
    from .config import env

    if _rank is not None:
        return str(_rank)
    return env("RANK") or "-"


class _Context(logging.Filter):
    """Adds `record.rank`, and passes records only while the application has no root handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = _current_rank()
        return not logging.getLogger().handlers


class TextFormatter(logging.Formatter):
    def __init__(self, hide_time: bool = False) -> None:
        fmt = "[rank %(rank)s] hvdlite %(levelname)s %(name)s: %(message)s"
        if not hide_time:
            fmt = "[%(asctime)s.%(msecs)03d] " + fmt
        super().__init__(fmt, datefmt="%Y-%m-%d %H:%M:%S")


class JsonFormatter(logging.Formatter):
    """One JSON object per record and line, for log shippers."""

    def __init__(self, hide_time: bool = False) -> None:
        super().__init__()
        self._hide_time = hide_time

    def format(self, record: logging.LogRecord) -> str:
        out: dict = {}
        if not self._hide_time:
            out["time"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created)) + \
                f".{int(record.msecs):03d}" + time.strftime("%z", time.localtime(record.created))
        out.update(rank=getattr(record, "rank", _current_rank()), level=record.levelname,
                   logger=record.name, message=record.getMessage())
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


class _Handler(logging.StreamHandler):
    """hvdlite's own handler, recognised so that a second set-up replaces it."""


def setup(level: Optional[str] = None, fmt: Optional[str] = None,
          hide_time: Optional[bool] = None, rank: Optional[int] = None) -> logging.Logger:
    """Configure the "hvdlite" logger; called by `init()`. Arguments default to the environment
    (HOROVOD_LOG_LEVEL, HVDLITE_LOG_FORMAT, HOROVOD_LOG_HIDE_TIME). A level the application set
    on "hvdlite" itself is kept unless HOROVOD_LOG_LEVEL is given."""
    from .config import choice, env_bool

    logger = logging.getLogger(ROOT)
    if rank is not None:
        set_rank(rank)
    level = level if level is not None else (choice("LOG_LEVEL", "") or None)
    if level is not None:
        name = str(level).strip().upper()
        if name not in LEVELS:
            raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
        logger.setLevel(LEVELS[name])
    elif logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)  # Horovod's default
    fmt = (fmt if fmt is not None else choice("LOG_FORMAT")).strip().lower()
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {fmt!r}")
    hide_time = env_bool("LOG_HIDE_TIME", False) if hide_time is None else hide_time
    for old in [h for h in logger.handlers if isinstance(h, _Handler)]:
        logger.removeHandler(old)
    handler = _Handler(sys.stderr)
    handler.addFilter(_Context())
    handler.setFormatter(JsonFormatter(hide_time) if fmt == "json" else TextFormatter(hide_time))
    logger.addHandler(handler)
    logger.propagate = True
    return logger
