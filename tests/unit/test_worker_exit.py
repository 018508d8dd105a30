"""A rank worker whose group broke leaves at once, whatever its teardown would wait for.

``python -m services.trainer.worker`` exits non-zero when its stage's group breaks, for its process
manager to start the ranks again (``test_runtime_cluster_ranks``: the trainer waits for the
surviving rank to exit). An interpreter exit first finalizes every module (torch's: 11 s at load
22, 40 s at load 25) and waits for non-daemon threads, while the heartbeat that would end the
process is frozen. Here ``serve`` fails while a non-daemon thread is still blocked (as a collective
on a dead peer is): the worker must still exit at once, with code 1, saying why.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BROKEN_GROUP = textwrap.dedent(
    """
    import sys
    import threading

    from services.trainer import worker

    def serve(config):
        # A thread that never ends, as a teardown blocked on a dead peer: a normal exit waits for it.
        threading.Thread(target=threading.Event().wait, name="blocked-on-a-dead-peer").start()
        raise RuntimeError("Read error: Connection reset by peer")

    worker.serve = serve
    sys.exit(worker.main())
    """
)


def test_a_worker_whose_group_broke_exits_at_once_with_code_1(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29999",
        "NEBULA_WORKER_TRAINER": "127.0.0.1:29998",
        "NEBULA_WORKER_DATA_DIR": str(tmp_path),
    }
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-c", BROKEN_GROUP],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        # The import of torch alone takes seconds on a loaded machine; a worker that waits for its
        # blocked thread never exits at all.
        _, err = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate(timeout=30)
        raise AssertionError(
            f"the worker did not exit within 120 s after its group broke:\n{err.decode(errors='replace')}"
        ) from None
    text = err.decode(errors="replace")
    assert process.returncode == 1, text
    assert "rank 0 stopped: RuntimeError: Read error: Connection reset by peer" in text, text
    print(f"exited in {time.monotonic() - started:.1f} s (torch import included)")
