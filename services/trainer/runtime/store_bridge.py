"""A rank box's torch store: one stage's keys of the rank store, reached over a socketpair to its worker.

A stage's code on a cluster rank runs in a box of its own (``services/trainer/rank_box.py``) with no
key and no way into the trainer's rank store: the store's gate wants the worker's certificate, and
the worker's loopback tunnel admits only the worker's own connections. What the box's ranks need of
the store (their compute group's rendezvous, the driver's command group, their reports) is one
stage's keys, ``stage/<n>/...``; this module carries exactly those.

``BridgedStore`` (in the box) is a ``torch.distributed.Store`` whose every call is one request on a
``multiprocessing.connection`` socketpair; ``StoreBridge`` (in the worker) answers each against a
``PrefixStore`` of the stage, so no key outside it can be named. Nothing is unpickled: a request is a
bounded JSON header and raw byte frames, checked before use, since the box runs a tenant's code.
A blocking ``get`` or ``wait`` is polled on the worker's side (``check`` every ``POLL_S``) rather than
blocked in the shared store client, so a box that waits forever on a key holds nothing of its
worker's when it is gone.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 << 10
MAX_VALUE_BYTES = 16 << 20
MAX_KEY_CHARS = 1024
MAX_KEYS = 256
POLL_S = 0.005
MAX_BRACKETS = 4
OK, FAILED, TIMED_OUT = b"\x00", b"\x01", b"\x02"
VALUES = {"set": 1, "compare_set": 2}
"""How many value frames follow each operation's header."""
OPERATIONS = ("set", "get", "add", "compare_set", "check", "wait", "delete_key", "num_keys")
WRITES = ("set", "add", "compare_set", "delete_key")
POSTED = frozenset({"spec", "owner", "signature", "signer", "finished"})
"""The keys the trainer posts a stage with, and its end: a box reads them, never writes them (a worker
that joins the stage later reads the spec and owner it finds there)."""


class BridgeError(RuntimeError):
    """A request that is not of this protocol (the worker drops the box's connection)."""


class BridgedStore(dist.Store):
    """The box's side: every call a request to the worker (one at a time: a lock orders them).

    ``spare``: a second connection to the same stage, which ``clone`` hands out (one store over it,
    whoever asks): a driver forms its command group on one while it watches the ranks on the other."""

    def __init__(self, conn: Connection, spare: Connection | None = None) -> None:
        super().__init__()
        self._conn = conn
        self._lock = threading.Lock()
        self._spare = BridgedStore(spare) if spare is not None else None

    def clone(self) -> BridgedStore:
        if self._spare is None:
            raise RuntimeError("this bridged store has no second connection to clone onto")
        self._spare.set_timeout(self.timeout)
        return self._spare

    def _call(self, op: str, values: tuple[bytes, ...] = (), **fields: Any) -> bytes:
        with self._lock:
            self._conn.send_bytes(json.dumps({"op": op, **fields}).encode())
            for value in values:
                self._conn.send_bytes(value)
            reply = self._conn.recv_bytes(MAX_VALUE_BYTES + 1)
        status, payload = reply[:1], reply[1:]
        if status == OK:
            return payload
        message = payload.decode(errors="replace")
        if status == TIMED_OUT:
            raise dist.DistStoreError(f"timeout: {message}")
        raise RuntimeError(f"the store bridge refused {op}: {message}")

    def _timeout_ms(self, timeout: datetime.timedelta | None = None) -> int:
        span = timeout if timeout is not None else self.timeout
        return int(span.total_seconds() * 1000)

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", (_bytes(value),), key=key)

    def get(self, key: str) -> bytes:
        return self._call("get", key=key, timeout_ms=self._timeout_ms())

    def add(self, key: str, value: int) -> int:
        return int(self._call("add", key=key, amount=int(value)))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._call("compare_set", (_bytes(expected), _bytes(desired)), key=key)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys=list(keys)) == b"1"

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._call("wait", keys=list(keys), timeout_ms=self._timeout_ms(timeout))

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key=key) == b"1"

    def num_keys(self) -> int:
        return int(self._call("num_keys"))


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class StoreBridge:
    """The worker's (or trainer's) side: answers one box's requests against ``stage`` (its stage's
    ``PrefixStore``) on a thread, until the box closes its end, breaks the protocol, or ``stop`` is
    called. A stage's driver in its box is bridged to each of its attempts' stages in turn (``use``);
    until the first, every request fails. The keys of ``POSTED`` are read-only."""

    def __init__(self, conn: Connection, stage: dist.Store | None, name: str = "store-bridge") -> None:
        self._conn = conn
        self._stage = stage
        self._stopped = threading.Event()
        self.refused = ""
        """Why the box's connection was dropped ("" while it was not): the stage's failure may say so."""
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def use(self, stage: dist.Store | None) -> None:
        """Answer later requests against ``stage`` (a re-attempt's; None: none until the next)."""
        self._stage = stage

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread (a poll in progress notices within ``POLL_S``) and close the connection."""
        self._stopped.set()
        self._thread.join(timeout)
        self._conn.close()

    def _serve(self) -> None:
        try:
            self._loop()
        finally:
            self._conn.close()  # the box sees its store end (EOF), whatever ended the loop

    def _loop(self) -> None:
        while not self._stopped.is_set():
            try:
                if not self._conn.poll(0.1):
                    continue
                request = _header(self._conn.recv_bytes(MAX_HEADER_BYTES))
                values = [self._conn.recv_bytes(MAX_VALUE_BYTES) for _ in range(VALUES.get(request["op"], 0))]
            except EOFError:
                return  # the box ended: nothing to answer
            except OSError as exc:  # multiprocessing's word for a frame over the bound, or a broken pair
                if "bad message length" in str(exc):
                    self.refused = f"a frame longer than the bridge takes ({MAX_VALUE_BYTES} bytes a value)"
                    log.warning("store bridge: dropped the box's connection: %s", self.refused)
                return
            except BridgeError as exc:
                self.refused = str(exc)
                log.warning("store bridge: dropped the box's connection: %s", exc)
                return
            try:
                reply = OK + self._answer(request, values)
            except TimeoutError as exc:
                reply = TIMED_OUT + str(exc).encode()
            except Exception as exc:  # the store's own error (a broken tunnel): the box fails saying so
                reply = FAILED + f"{type(exc).__name__}: {exc}".encode()
            try:
                self._conn.send_bytes(reply)
            except OSError:
                return

    def _answer(self, request: dict[str, Any], values: list[bytes]) -> bytes:
        op, stage = request["op"], self._stage
        if stage is None:
            raise LookupError("no stage is bridged yet: ask for the ranks first")
        if op in WRITES and request["key"] in POSTED:
            raise PermissionError(f"{request['key']!r} is the trainer's to write, not the box's")
        if op == "set":
            stage.set(request["key"], values[0])
            return b""
        if op == "get":
            self._until_present([request["key"]], request["timeout_ms"])
            return bytes(stage.get(request["key"]))
        if op == "add":
            return str(stage.add(request["key"], request["amount"])).encode()
        if op == "compare_set":
            return bytes(stage.compare_set(request["key"], values[0], values[1]))
        if op == "check":
            return b"1" if stage.check(request["keys"]) else b"0"
        if op == "wait":
            self._until_present(request["keys"], request["timeout_ms"])
            return b""
        if op == "delete_key":
            return b"1" if stage.delete_key(request["key"]) else b"0"
        return str(stage.num_keys()).encode()  # num_keys: the whole store's, as a TCPStore's is

    def _until_present(self, keys: list[str], timeout_ms: int) -> None:
        deadline, stage = time.monotonic() + timeout_ms / 1000, self._stage
        assert stage is not None
        while not stage.check(keys):
            if self._stopped.is_set():
                raise TimeoutError("the worker stopped this stage's store bridge")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"waited {timeout_ms} ms for keys {keys}")
            time.sleep(POLL_S)


def _header(raw: bytes) -> dict[str, Any]:
    """A request header, every field checked (the box runs a tenant's code)."""
    # Flat by protocol (one list at most): deep nesting is refused before the parser recurses into it.
    if raw.count(b"[") + raw.count(b"{") > MAX_BRACKETS:
        raise BridgeError("a request that is not JSON of this protocol: nested too deeply")
    try:
        request = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BridgeError(f"a request that is not JSON: {exc}") from None
    if not isinstance(request, dict) or request.get("op") not in OPERATIONS:
        raise BridgeError(f"not a store operation: {str(request)[:80]!r}")
    if "key" in request or request["op"] in ("set", "get", "add", "compare_set", "delete_key"):
        _key(request.get("key"))
    if request["op"] in ("check", "wait"):
        keys = request.get("keys")
        if not isinstance(keys, list) or not 0 < len(keys) <= MAX_KEYS:
            raise BridgeError(f"{request['op']} needs 1 to {MAX_KEYS} keys")
        for key in keys:
            _key(key)
    if request["op"] in ("get", "wait"):
        timeout = request.get("timeout_ms")
        if not isinstance(timeout, int) or isinstance(timeout, bool) or not 0 <= timeout <= 86_400_000:
            raise BridgeError(f"timeout_ms must be an integer of 0 to 86400000, got {timeout!r}")
    if request["op"] == "add":
        amount = request.get("amount")
        if not isinstance(amount, int) or isinstance(amount, bool) or abs(amount) >= 1 << 62:
            raise BridgeError(f"add needs an integer amount below 2**62, got {amount!r}")
    return request


def _key(key: object) -> None:
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS:
        raise BridgeError(f"a key must be a string of 1 to {MAX_KEY_CHARS} characters, got {str(key)[:80]!r}")


__all__ = ["POSTED", "BridgeError", "BridgedStore", "StoreBridge"]
