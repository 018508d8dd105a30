"""The switch's stderr tap loses no byte when the process ends with ``os._exit`` right after writing.

The service host ends a stopped service with ``os._exit``, which does not wait for the tap's daemon
thread; CI once saw a switch's last log line ("stopped") vanish that way. These tests run a real
process with the tap on its fd 2 and compare what reached the parent's pipe with what was written.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parents[2]

# 4 MiB through a 64 KiB pipe: when the writer returns, up to a pipe's worth is still in the tap's
# pipe, so ending at once without draining loses the tail on nearly every run.
PROGRAM = textwrap.dedent(
    """
    import os, sys
    from nebula_common.service import host
    from services.switch.tls_refusals import StderrTap

    refusals = []
    tap = StderrTap(refusals.append)
    host.before_process_end(tap.close)
    line = b"x" * 1023 + b"\\n"
    for _ in range(4096):
        os.write(2, line)
    os.write(2, b"Handshake failed with error SSL_ERROR_SSL: x:OPENSSL_internal:WRONG_VERSION_NUMBER\\n")
    os.write(2, b"last line\\n")
    sys.stdout.write("refusals before exit: %d\\n" % len(refusals))
    host._end_process(0)
    """
)


def test_every_byte_written_to_stderr_reaches_the_original_stderr_before_the_process_ends() -> None:
    for attempt in range(5):
        done = subprocess.run(
            [sys.executable, "-c", PROGRAM], cwd=REPO_ROOT, capture_output=True, timeout=50, check=False
        )
        assert done.returncode == 0, done.stderr[-2000:]
        lines = done.stderr.split(b"\n")
        assert lines[-1] == b"" and lines[-2] == b"last line", (attempt, done.stderr[-300:])
        assert lines.count(b"x" * 1023) == 4096, (attempt, len(done.stderr))
        assert b"WRONG_VERSION_NUMBER" in done.stderr


def test_close_hands_fd_2_back_and_ends_the_pump() -> None:
    program = textwrap.dedent(
        """
        import os
        from services.switch.tls_refusals import StderrTap

        seen = []
        tap = StderrTap(seen.append)
        refusal = b"Handshake failed with fatal error SSL_ERROR_SSL: e:OPENSSL_internal:NO_SHARED_CIPHER"
        os.write(2, refusal + b"\\n")
        assert tap.close(), "the tap's pump did not end"
        os.write(2, b"after close\\n")
        print(seen)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=REPO_ROOT, capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['NO_SHARED_CIPHER']"
    assert done.stderr.endswith("after close\n")
