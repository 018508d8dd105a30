"""`nebula job list` keeps every id whole at any width, and the CLI answers without importing torch.

The list is rendered from real trainer records (``StageRecordInfo`` as ``ListStages`` returns them);
the start-up checks run the CLI in a fresh interpreter, as a user does (the time itself is measured by
``make bench-cli``, not here).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from rich.console import Console

from nebula_common.cli.job_view import jobs_table
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.job_records import JobRecord, StageView

pytestmark = pytest.mark.timeout(120)

LONG_ID = "numbers-1f2e3d4c-with-a-long-experiment-name"


def _record(job_id: str) -> JobRecord:
    stages = []
    for cluster, stage, edge in (("a", "encoder", "encoder->decoder"), ("b", "decoder", "encoder->decoder")):
        info = trainer_pb2.StageRecordInfo(
            status=trainer_pb2.StageStatus(
                stage=stage, state=trainer_pb2.STAGE_STATE_SUCCEEDED, steps_done=60, loss=0.6588
            ),
            owner=f"job-{cluster}1b2c3d",
            started_unix=1_800_000_000.0,
            ended_unix=1_800_000_060.0,
            steps=60,
            edge=edge,
        )
        stages.append(StageView.from_info(cluster, info))
    return JobRecord(job_id, stages)


def _render(width: int, jobs: list[JobRecord]) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(jobs_table(jobs, width))
    return console.export_text()


@pytest.mark.parametrize("width", [200, 120, 80, 60])
def test_ids_are_whole_at_every_width(width: int) -> None:
    jobs = [_record(LONG_ID), _record("short")]
    text = _render(width, jobs)
    assert LONG_ID in text and "short" in text, text
    assert all(len(line) <= width for line in text.splitlines()), text
    assert "SUCCEEDED" in text


def test_columns_leave_in_order_as_the_terminal_narrows() -> None:
    jobs = [_record(LONG_ID)]
    wide, narrow = _render(200, jobs), _render(80, jobs)
    assert "started (UTC)" in wide and "owners" in wide
    assert "started (UTC)" not in narrow and "0.6588" in narrow  # the dates go first, the loss stays


def _run(*args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60)
    return time.perf_counter() - started, done


def test_help_and_list_are_served_by_the_light_modules() -> None:
    _, done = _run("-m", "nebula_common.cli.app", "job", "list", "--help")
    assert done.returncode == 0 and "--output" in done.stdout, done.stderr


def test_no_command_group_imports_torch_to_start() -> None:
    heavy = "('torch', 'pydantic', 'numpy')"
    code = f"import sys, nebula_common.cli.app; print(sorted(m for m in {heavy} if m in sys.modules))"
    _, done = _run("-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
