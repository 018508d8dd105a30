"""A stage whose sandbox dies before it starts is reported with its exit and its own last words."""

from __future__ import annotations

from pathlib import Path

import pytest

from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer import stage_launch
from services.trainer.sandbox import Confinement, StageLimits
from services.trainer.stage_log import TAIL_LINE_CHARS
from services.trainer.stage_process import StageProcess

LIMITS = StageLimits(memory_bytes=1 << 30, cpu_seconds=60, open_files=256)


def _stage(tmp_path: Path) -> StageProcess:
    spec = trainer_pb2.StageSpec(
        job_id="job-1", stage="encoder", program=trainer_pb2.ProgramStage(role="upstream")
    )
    return StageProcess(
        spec,
        "token",
        "127.0.0.1:1",
        tmp_path / "data",
        "alice",
        confinement=Confinement("bwrap", cgroups_missing="not in this test", seccomp_missing="not here"),
        limits=LIMITS,
    )


def _failed_message(stage: StageProcess) -> str:
    stage.start()
    stage.join(30)
    assert not stage.is_alive(), "the stage's end was not recorded within 30 s"
    status = stage.board.latest()
    assert status.state == trainer_pb2.STAGE_STATE_FAILED, status
    return status.message


def test_a_sandbox_that_dies_at_once_is_reported_with_its_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What an unprivileged container without user namespaces gives bubblewrap: it writes why, exits 1.
    words = ["setting up the sandbox", "bwrap: No permissions to create new namespace"]
    script = "; ".join(f"echo '{line}' >&2" for line in words) + "; exit 1"
    monkeypatch.setattr(stage_launch, "bwrap_command", lambda *_args, **_kwargs: ["sh", "-c", script])
    message = _failed_message(_stage(tmp_path))
    assert message.startswith("the stage process exited (1) before the stage ended: it did not start")
    assert "it closed its channel before HELLO" in message and "EOFError" not in message
    assert message.endswith("its stderr ended: " + " | ".join(words)), message


def test_a_silent_death_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stage_launch, "bwrap_command", lambda *_args, **_kwargs: ["sh", "-c", "kill -9 $$"])
    message = _failed_message(_stage(tmp_path))
    assert message.startswith("the stage process was killed by signal 9 before the stage ended")
    assert message.endswith("; it wrote nothing to stderr"), message


def test_only_the_last_lines_are_quoted_and_each_is_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = (
        "for i in $(seq 1 40); do echo line-$i >&2; done; head -c 2000 /dev/zero | tr '\\0' x >&2; exit 2"
    )
    monkeypatch.setattr(stage_launch, "bwrap_command", lambda *_args, **_kwargs: ["sh", "-c", script])
    message = _failed_message(_stage(tmp_path))
    quoted = message.split("its stderr ended: ", 1)[1].split(" | ")
    assert quoted[:4] == ["line-37", "line-38", "line-39", "line-40"]
    assert quoted[4] == "x" * TAIL_LINE_CHARS
    assert len(message) < 1000
