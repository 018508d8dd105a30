"""Audit TLS handshakes that gRPC refuses before any Python code runs.

gRPC's TLS stack rejects a client without a certificate, with an unknown CA, an expired or
not-yet-valid certificate, or a name-constraint violation inside the handshake; no servicer is
called and Python gets no callback. gRPC core does report each failure on stderr (``Handshake
failed with error SSL_ERROR_SSL: ...: certificate has expired``). This module puts a pipe in front
of file descriptor 2, copies every byte through to the original stderr unchanged, and turns each
such line into an audit record. The line does not carry the peer's address, so the record has the
reason and time only; the connecting address is in the emulator's or firewall's logs.

Installed only by the switch's ``main`` (it rewires the process's stderr), never in tests that run
the switch in-process. The process ends with ``os._exit`` once the service has stopped
(``nebula_common/service/host.py``), which does not wait for the tap's daemon thread: ``close`` puts the
original stderr back and waits until every byte written before it has been forwarded, so the last
lines (the host's "stopped") are never lost in the pipe.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable

HANDSHAKE_FAILED = re.compile(rb"Handshake failed with (?:fatal )?error (?P<code>\S+): (?P<reason>.*)$")


def parse_refusal(line: bytes) -> str | None:
    """The reason in a gRPC handshake-failure log line, or None for any other line."""
    match = HANDSHAKE_FAILED.search(line.rstrip())
    if match is None:
        return None
    reason = match["reason"].decode(errors="replace")
    # "error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: certificate has expired"
    return reason.split("OPENSSL_internal:")[-1].strip() or reason


class StderrTap:
    """Forward fd 2 through a pipe and report gRPC handshake refusals to ``on_refusal``."""

    def __init__(self, on_refusal: Callable[[str], None]) -> None:
        self._on_refusal = on_refusal
        self._original = os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)
        self._read_end = read_end
        self._thread = threading.Thread(target=self._pump, name="stderr-tap", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> bool:
        """Put the original stderr back on fd 2 and wait until the pipe is drained; True once it is.

        ``dup2`` closes the pipe's only write end, so the pump forwards what is left and then reads
        end-of-file. The wait has a deadline: a child process that inherited fd 2 would keep the
        write end open, and the process must still end.
        """
        with contextlib.suppress(OSError):
            os.dup2(self._original, 2)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _pump(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self._read_end, 65536)
            except OSError:
                return
            if not chunk:
                return
            # Forward first: the tap must never hold back or lose a log line.
            with contextlib.suppress(OSError):
                os.write(self._original, chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            pending = pending[-65536:]
            for line in lines:
                reason = parse_refusal(line)
                if reason is not None:
                    with contextlib.suppress(Exception):  # auditing must not kill the tap
                        self._on_refusal(reason)
