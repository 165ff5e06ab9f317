"""hvdlite's logging: module loggers that propagate (caplog, the application's handlers), and the
default handler's text and JSON formats with time and rank."""
from __future__ import annotations

import json
import logging
import re

import pytest

from hvdlite.common import logs
from hvdlite.common.config import Settings
from hvdlite.common.stall import StallInspector
from util import hvdlite_run

STALL_ENV = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "30", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5"}


@pytest.mark.timeout(30)
def test_caplog_sees_hvdlite_records(caplog, capfd, monkeypatch):
    monkeypatch.delenv("HOROVOD_LOG_LEVEL", raising=False)
    monkeypatch.delenv("HVDLITE_LOG_LEVEL", raising=False)
    logs.setup()  # what hvd.init() does
    with caplog.at_level(logging.WARNING):
        StallInspector(Settings(stall_warning_s=30, stall_shutdown_s=5))
    records = [r for r in caplog.records if r.name == "hvdlite.common.stall"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "below the stall warning time" in records[0].getMessage()
    # pytest's handlers sit on the root logger, so hvdlite's own handler stays quiet: no double.
    assert "below the stall warning time" not in capfd.readouterr().err
    logging.getLogger("hvdlite").setLevel(logging.NOTSET)


@pytest.mark.timeout(30)
def test_level_and_format_settings(monkeypatch):
    monkeypatch.setenv("HOROVOD_LOG_LEVEL", "debug")
    assert logs.setup().level == logging.DEBUG
    monkeypatch.setenv("HOROVOD_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="HOROVOD_LOG_LEVEL='loud' is not one of trace, debug, "
                                         "info, warning, warn, error, fatal, critical"):
        logs.setup()
    with pytest.raises(ValueError, match="log level must be one of"):
        logs.setup(level="loud")
    monkeypatch.delenv("HOROVOD_LOG_LEVEL")
    monkeypatch.setenv("HVDLITE_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match="HVDLITE_LOG_FORMAT='xml' is not one of text, json"):
        logs.setup()
    monkeypatch.delenv("HVDLITE_LOG_FORMAT")
    with pytest.raises(ValueError, match="log format must be 'text' or 'json'"):
        logs.setup(fmt="xml")
    logging.getLogger("hvdlite").setLevel(logging.NOTSET)


@pytest.mark.timeout(120)
def test_default_handler_text_json_and_app_config():
    # Rank 0: hvdlite's own handler, with time and rank in every line. Rank 1's application
    # configured logging first: it gets hvdlite's records once, in its own format.
    out = hvdlite_run("log_records.py", np=2, args=["app-on-rank-1"], env=STALL_ENV)
    text = [line for line in out.stderr.splitlines() if "hvdlite.test" in line]
    assert len(text) == 2, out.stderr
    assert re.fullmatch(r"\[0\]<stderr>:\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}\] "
                        r"\[rank 0\] hvdlite WARNING hvdlite\.test: from rank 0", text[0]
                        if text[0].startswith("[0]") else text[1]), out.stderr
    assert "[1]<stderr>:APP WARNING hvdlite.test: from rank 1" in text, out.stderr
    assert re.search(r"\[0\]<stderr>:.*\[rank 0\] hvdlite WARNING hvdlite\.common\.stall: "
                     r"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", out.stderr), out.stderr

    # JSON lines, without time (--log-without-timestamp).
    out = hvdlite_run("log_records.py", np=2, launcher_args=["--log-without-timestamp"],
                      env={**STALL_ENV, "HVDLITE_LOG_FORMAT": "json"})
    records = []
    for line in out.stderr.splitlines():
        m = re.fullmatch(r"\[(\d)\]<stderr>:(\{.*\})", line)
        if m:
            record = json.loads(m.group(2))
            assert record["rank"] == m.group(1) and "time" not in record
            records.append(record)
    assert {(r["rank"], r["message"]) for r in records if r["logger"] == "hvdlite.test"} == \
        {("0", "from rank 0"), ("1", "from rank 1")}, out.stderr
    assert any(r["logger"] == "hvdlite.common.stall" and r["level"] == "WARNING"
               for r in records), out.stderr
