"""The control channel between a trainer and one of its stage processes: a socketpair, framed messages.

Framing is ``multiprocessing.connection``'s (a length, then the bytes); each message is one kind byte
and a payload. Nothing is ever unpickled: the stage process runs a tenant's code, so everything the
trainer reads from it is parsed as a bounded protobuf or JSON and checked (``stage_supervision``).

Trainer -> stage: ``START`` (JSON: the settings below), ``SPEC`` (a ``StageSpec``), ``CANCEL``,
``EPOCH_OK`` (the epoch the stage announced is on disk). Stage -> trainer: ``HELLO`` (first, before it
loads anything: the trainer puts it into its control group now, then sends ``START``), ``STATUS`` (a
``StageStatus``: the stage's board, in order), ``STEP`` (JSON: one step's numbers for ``/metrics``),
``EPOCH`` (JSON: the stage is about to open this epoch; it waits for ``EPOCH_OK``).

A stage on the cluster's ranks also asks for them: ``RANKS`` (JSON ``{"op": ...}``: ``attach`` with the
attempt's ``resume_step`` or null, ``why`` with the error its group saw, ``finish``, ``abort``), each
answered in order by one ``RANKS_REPLY`` (JSON: the op's result, or ``{"error": ...}``) but ``abort``,
which has no answer (``stage_ranks``).
"""

from __future__ import annotations

import json
from multiprocessing.connection import Connection
from typing import Any

START, SPEC, CANCEL, EPOCH_OK = b"A", b"P", b"C", b"K"
STATUS, STEP, EPOCH, HELLO = b"S", b"M", b"E", b"H"
RANKS, RANKS_REPLY = b"R", b"Y"
MAX_MESSAGE_BYTES = 64 << 20
"""Largest message either side accepts (a spec carries the module source and a hot start's weights)."""


class ChannelError(RuntimeError):
    """The other side sent something that is not a message of this protocol (or went away)."""


def send(conn: Connection, kind: bytes, payload: bytes = b"") -> None:
    conn.send_bytes(kind + payload)


def send_json(conn: Connection, kind: bytes, body: dict[str, Any]) -> None:
    send(conn, kind, json.dumps(body).encode())


def receive(conn: Connection) -> tuple[bytes, bytes]:
    """The next message's (kind, payload); ``EOFError`` when the other side closed."""
    try:
        message = conn.recv_bytes(MAX_MESSAGE_BYTES)
    except OSError as exc:  # longer than the bound, or the socket broke
        raise ChannelError(f"bad message on the stage channel: {exc}") from exc
    if not message:
        raise ChannelError("empty message on the stage channel")
    return message[:1], message[1:]


def parse_json(payload: bytes) -> dict[str, Any]:
    """The JSON object in ``payload``; ChannelError for anything else (not JSON, nested too deep, not an
    object): the stage process runs a tenant's code, so its bytes must not raise anything else."""
    try:
        body = json.loads(payload)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ChannelError(f"stage channel message is not JSON: {exc}") from exc
    except RecursionError:  # ``[[[[...`` nested past the interpreter's limit (json's C scanner recurses)
        raise ChannelError("stage channel message nests JSON arrays or objects too deeply") from None
    if not isinstance(body, dict):
        raise ChannelError("stage channel message is not a JSON object")
    return body


__all__ = [
    "CANCEL",
    "EPOCH",
    "EPOCH_OK",
    "HELLO",
    "MAX_MESSAGE_BYTES",
    "RANKS",
    "RANKS_REPLY",
    "SPEC",
    "START",
    "STATUS",
    "STEP",
    "ChannelError",
    "parse_json",
    "receive",
    "send",
    "send_json",
]
