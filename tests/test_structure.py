"""The structure the code keeps: checks on the source itself, no processes started.

- the wire protocol is a schema (common/protocol.py): unique tags per table, every kind
  documented, every frame the code builds or sends one of its kinds.
"""
from __future__ import annotations

import ast
import pathlib
import socket

import pytest

from hvdlite.common import protocol
from hvdlite.common.wire import Channel, ProtocolError

ROOT = pathlib.Path(__file__).resolve().parent.parent / "hvdlite"
SOURCES = sorted(ROOT.rglob("*.py"))
TABLES = {table.__name__: table for table in protocol.KINDS}
CHANNELS = {protocol.TO_COORDINATOR, protocol.TO_RANK, protocol.PEER, protocol.RESPONSE_ITEM,
            protocol.WORKER_TO_DRIVER, protocol.DRIVER_TO_WORKER}


def _trees():
    for path in SOURCES:
        yield path, ast.parse(path.read_text(), str(path))


# ------------------------------------------------------------------------------ wire schema
@pytest.mark.parametrize("table", protocol.KINDS, ids=lambda t: t.__name__)
def test_tags_are_unique_and_every_kind_is_documented(table):
    members = list(table.__members__.items())
    tags = [kind.value for _, kind in members]
    # __members__ lists aliases too: an alias (a repeated tag) shows up as a second name.
    assert len(tags) == len(set(tags)), f"{table.__name__} repeats a tag: {tags}"
    for name, kind in members:
        assert kind.name == name
        assert kind.channel in CHANNELS, f"{table.__name__}.{name}: unknown channel"
        assert kind.doc and kind.doc.startswith(f'("{kind.value}"'), \
            f"{table.__name__}.{name}: its doc should show the frame, starting with its tag"


def test_tags_are_unique_within_each_channel():
    seen: dict = {}
    for table in protocol.KINDS:
        for kind in table:
            other = seen.setdefault((kind.channel, kind.value), kind)
            assert other is kind, f"{other!r} and {kind!r} share a tag on {kind.channel}"
    assert protocol.Msg.ROUND is not protocol.Msg.HEARTBEAT


def test_every_frame_the_code_builds_is_in_the_schema():
    """A tuple that starts with `Msg.X` (or another table's member) names a kind that exists,
    and a frame sent with a bare string tag is one of the schema's tags."""
    refs = sends = 0
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Tuple) and node.elts:
                head = node.elts[0]
                if (isinstance(head, ast.Attribute) and isinstance(head.value, ast.Name)
                        and head.value.id in TABLES):
                    refs += 1
                    assert head.attr in TABLES[head.value.id].__members__, \
                        f"{path}:{node.lineno}: {head.value.id}.{head.attr} is not in the schema"
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "send" and node.args
                    and isinstance(node.args[0], ast.Tuple) and node.args[0].elts
                    and isinstance(node.args[0].elts[0], ast.Constant)
                    and isinstance(node.args[0].elts[0].value, str)):
                sends += 1
                tag = node.args[0].elts[0].value
                assert tag in protocol.FRAME_TAGS, \
                    f"{path}:{node.lineno}: sends a frame tagged {tag!r}, not in protocol.py"
    assert refs > 20 and sends > 3      # the scan found the send sites


def test_the_framing_layer_refuses_a_frame_outside_the_schema():
    server = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(server.getsockname(), timeout=5)
    b, _ = server.accept()
    server.close()
    try:
        left, right = Channel(a, b"k" * 32), Channel(b, b"k" * 32)
        with pytest.raises(ProtocolError, match="not in the protocol schema"):
            left.send(("NOT A KIND", 1))
        with pytest.raises(ProtocolError, match="not in the protocol schema"):
            left.send("a bare string")
        left.send((protocol.Msg.ROUND, 0, 1, 2, 3, 4, False))
        right.sock.settimeout(5)
        assert right.recv_blocking(5) == ("O", 0, 1, 2, 3, 4, False)
    finally:
        a.close()
        b.close()
