"""A stage's per-step history file (``services/trainer/history.py``): what is written, what is read back."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer import history
from services.trainer.history import COLUMNS, StepHistory, history_path, read_history
from services.trainer.status import StatusBoard

RUNNING, SUCCEEDED = trainer_pb2.STAGE_STATE_RUNNING, trainer_pb2.STAGE_STATE_SUCCEEDED


def _train(board: StatusBoard, steps: int) -> None:
    board.update(state=RUNNING, codec_forward="int8", codec_backward="fp16")
    for step in range(1, steps + 1):
        board.update(state=RUNNING, steps_done=step, loss=1 / step, step_seconds=0.1 * step, bytes_sent=step)
        board.update(message="a message is no step")  # same step, epoch and state: no row
    board.update(state=SUCCEEDED, message="done")


def test_every_step_is_one_row_a_spreadsheet_reads_and_the_trainer_reads_back(tmp_path: Path) -> None:
    path = history_path(tmp_path / "job-1.json")
    assert path.name == "job-1.steps.csv"
    board, writer = StatusBoard("job-1", "encoder"), StepHistory(path)
    board.subscribe(writer.record)
    _train(board, 5)
    writer.close()
    assert path.stat().st_mode & 0o777 == 0o600
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert tuple(rows[0]) == COLUMNS
    assert [r["steps_done"] for r in rows] == ["0", "1", "2", "3", "4", "5", "5"]
    assert rows[3]["loss"] == repr(1 / 3) and rows[0]["loss"] == "" and rows[-1]["state"] == "SUCCEEDED"
    statuses = read_history(path, "job-1", "encoder")
    assert [s.steps_done for s in statuses] == [0, 1, 2, 3, 4, 5, 5]
    assert statuses[3].loss == 1 / 3 and not statuses[0].HasField("loss")  # exact, and absent stays absent
    assert statuses[2].step_seconds == 0.2 and statuses[5].bytes_sent == 5
    assert statuses[-1].state == SUCCEEDED and statuses[-1].message == "done"
    assert {s.job_id for s in statuses} == {"job-1"} and statuses[1].codec_forward == "int8"


def test_a_torn_or_damaged_row_is_skipped_and_a_restart_appends(tmp_path: Path) -> None:
    path = tmp_path / "job-2.steps.csv"
    first = StepHistory(path)
    board = StatusBoard("job-2", "decoder")
    board.subscribe(first.record)
    board.update(state=RUNNING, steps_done=1, loss=0.5)
    first.close()
    with path.open("a") as handle:
        handle.write("1700000000.0,RUNNING,2,0,not-a-number\n")  # damaged
        handle.write("1700000000.0,RUNNING,3,0")  # a kill mid-row
    with path.open("a") as handle:
        handle.write("\n")
    again = StepHistory(path)  # a restarted trainer, same stage, next epoch
    board = StatusBoard("job-2", "decoder")
    board.subscribe(again.record)
    board.update(state=RUNNING, steps_done=2, epoch=1, loss=0.25)
    again.close()
    statuses = read_history(path, "job-2", "decoder")
    assert [(s.steps_done, s.epoch) for s in statuses] == [(1, 0), (2, 1)]
    assert path.read_text().count("unix_time") == 1  # one header
    assert read_history(tmp_path / "none.steps.csv", "x", "y") == []


def test_past_the_row_bound_only_changes_of_state_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(history, "MAX_ROWS", 3)
    path = tmp_path / "job-3.steps.csv"
    board, writer = StatusBoard("job-3", "encoder"), StepHistory(path)
    board.subscribe(writer.record)
    _train(board, 10)
    writer.close()
    assert [s.steps_done for s in read_history(path, "job-3", "encoder")] == [0, 1, 2, 10]


def test_a_history_that_cannot_be_written_never_stops_the_stage(tmp_path: Path) -> None:
    writer = StepHistory(tmp_path / "missing-dir" / "job.steps.csv")
    board = StatusBoard("job", "encoder")
    board.subscribe(writer.record)
    board.update(state=RUNNING, steps_done=1)  # logged, not raised
    writer.close()
    assert board.latest().steps_done == 1
