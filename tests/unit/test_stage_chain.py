"""Chains of three and four stages on in-memory edges: split equals unsplit, lossy edges train alike.

Every stage of ``examples/chain`` (reader -> mixer -> head; the 4-stage variant runs the mixer
twice) runs as a real ``ProgramRunner`` in a thread of this process, each edge its own
``MemoryLink`` (the first stage on one end of edge 0, each middle on edge K-1 and edge K, the
last on the end of the last edge). With codec ``none`` and a fixed seed the chain must reproduce
the unsplit model trained in one process (``run_unsplit``): the same per-step losses and final
parameters (1e-5); with a lossy codec on each edge it must end within 2% of that loss. A
restarted middle or end stage, or an outage on one edge, makes the whole chain resume from the
checkpoint every stage holds and end exactly like an uninterrupted run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from nebula_common.errors import InvalidRequestError
from nebula_common.jobspec import SpecError, load_spec
from nebula_common.jobspec.reference import UnsplitResult, run_unsplit
from nebula_common.jobspec.spec import MAX_STAGES
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.summary import JobSummary, chain_edges
from services.trainer.edge import EdgeConnection, EdgeSettings, stage_edge
from services.trainer.edge.memory import MemoryLink, MemoryTransport
from services.trainer.runtime.lifecycle import PEER_CANCELLED
from services.trainer.validation import validate_stage_spec
from tests.support.edges import StageRun, finish, runner_with_edges, wait_for, wait_for_step

pytestmark = pytest.mark.timeout(300)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "chain" / "job.yaml"
SETTINGS = EdgeSettings(window_bytes=1 << 20, max_outage_s=20.0, retransmit_s=0.3, ready_timeout_s=30)
SHORT_OUTAGE = EdgeSettings(window_bytes=1 << 20, max_outage_s=0.5, retransmit_s=0.3, ready_timeout_s=30)
SUCCEEDED = trainer_pb2.STAGE_STATE_SUCCEEDED
RECOVERING = trainer_pb2.STAGE_STATE_RECOVERING
STEPS = 12
LOSSY_STEPS = 40


def chain_fields(
    stages: int = 3, steps: int = STEPS, codecs: tuple[str, ...] = (), width: int = 16
) -> dict[str, Any]:
    """The example chain as a dict: ``stages`` of them (the mixer repeated), ``codecs`` per edge."""
    fields: dict[str, Any] = {
        "steps": steps,
        "data": {"batch_size": 16, "micro_batches": 2, "examples": 10000},
        "checkpoint": {"interval": 2},
    }
    names = ["reader"] + [f"mixer{k}" for k in range(1, stages - 1)] + ["head"]
    modules = ["reader.py"] + ["mixer.py"] * (stages - 2) + ["head.py"]
    fields["stages"] = [
        {
            "name": name,
            "cluster": "abcdefghi"[i],
            "module": module,
            "options": {"width": width, "classes": 37},
        }
        for i, (name, module) in enumerate(zip(names, modules, strict=True))
    ]
    fields["stages"][0]["options"] = {"width": width}
    for stage in fields["stages"][1:-1]:
        stage["options"] = {"width": width}
    fields["edges"] = [
        {
            "from": names[i],
            "to": names[i + 1],
            "codec": {
                "forward": codecs[i] if codecs else "none",
                "backward": codecs[i] if codecs else "none",
            },
        }
        for i in range(stages - 1)
    ]
    return fields


def chain_job(
    stages: int = 3, steps: int = STEPS, codecs: tuple[str, ...] = (), width: int = 16, **top: Any
) -> ProgramJob:
    base = load_spec(EXAMPLE)  # the example's pipeline, optimizer and seed
    spec = base.spec.model_dump(mode="json", by_alias=True)
    spec.update(chain_fields(stages, steps, codecs, width))
    spec.update(top)
    return ProgramJob(load_spec(spec, base_dir=EXAMPLE.parent))


def chain_runner(
    job: ProgramJob,
    index: int,
    data_dir: Path,
    links: list[MemoryLink],
    settings: EdgeSettings,
    *,
    epoch: int = 0,
) -> StageRun:
    """A ``ProgramRunner`` (not started) for stage ``index``; edge K is ``links[K]``, stage K its end 0."""
    name = job.spec.stages[index].name
    validate_stage_spec(job.stage_spec(name))  # what the trainer checks before it runs a stage
    edge_index = {edge.name: k for k, edge in enumerate(job.spec.edges)}

    def open_edge(
        view: trainer_pb2.StageSpec, edge_settings: EdgeSettings, edge_epoch: int, run: StageRun
    ) -> EdgeConnection:
        link = links[edge_index[view.edge]]
        side = 0 if view.program.role == "upstream" else 1
        transport = link.ends[side] if edge_epoch == 0 else link.open_end(side, edge_epoch)
        run.epochs.append(edge_epoch)
        return stage_edge(view, transport, edge_settings, edge_epoch)

    return runner_with_edges(job, name, data_dir, settings, open_edge, epoch=epoch)


def run_chain(
    job: ProgramJob, data_dir: Path, settings: EdgeSettings = SETTINGS, timeout: float = 240
) -> list[StageRun]:
    links = [MemoryLink() for _ in job.spec.edges]
    runs = [chain_runner(job, i, data_dir, links, settings) for i in range(len(job.spec.stages))]
    for run in runs:
        run.runner.start()
    for run in runs:
        finish(run, timeout)
    return runs


def check_equals_unsplit(runs: list[StageRun], reference: UnsplitResult, steps: int, start: int = 0) -> None:
    for run in runs:
        assert run.final.state == SUCCEEDED, (run.final.stage, run.final.message)
    losses = runs[-1].losses()  # a restarted last stage reports the steps from its resume on
    first = min(losses)
    assert sorted(losses) == list(range(first, steps)) and first in (start, runs[-1].final.resumed_from_step)
    for step in range(first, steps):
        assert losses[step] == pytest.approx(reference.losses[step], abs=1e-5), step
    for run in runs:
        state = reference.state_dicts[run.final.stage]
        assert run.runner.program is not None
        ours = run.runner.program.model.state_dict()
        assert list(ours) == list(state)
        for key, value in ours.items():
            torch.testing.assert_close(value, state[key], rtol=0, atol=1e-5)


@pytest.mark.parametrize("stages", range(2, MAX_STAGES + 1))  # every chain length a spec allows
def test_a_chain_with_codec_none_equals_the_unsplit_model(tmp_path: Path, stages: int) -> None:
    job = chain_job(stages)
    reference = run_unsplit(job.loaded)
    runs = run_chain(job, tmp_path)
    check_equals_unsplit(runs, reference, STEPS)
    for middle in (run.final for run in runs[1:-1]):
        assert not middle.HasField("loss")  # only the last stage owns the loss
        assert middle.bytes_sent > 0 and middle.bytes_received > 0  # both of its edges counted


def test_a_chain_with_1f1b_equals_the_unsplit_model(tmp_path: Path) -> None:
    job = chain_job(
        3,
        pipeline={"schedule": "1f1b", "max_in_flight": 2},
        data={"batch_size": 16, "micro_batches": 4, "examples": 10000},
    )
    check_equals_unsplit(run_chain(job, tmp_path), run_unsplit(job.loaded), STEPS)


def test_lossy_codecs_on_each_edge_train_to_within_two_percent_of_the_unsplit_loss(tmp_path: Path) -> None:
    # Width 32: int8's per-tensor scale (4 bytes) is then 1.6% of a micro-batch's 256 bytes, not 3%.
    exact = chain_job(3, LOSSY_STEPS, width=32)
    reference = run_unsplit(exact.loaded)
    job = chain_job(3, LOSSY_STEPS, codecs=("fp16", "int8"), width=32)
    runs = run_chain(job, tmp_path)
    for run in runs:
        assert run.final.state == SUCCEEDED, (run.final.stage, run.final.message)
    losses = runs[-1].losses()
    # The final loss, as the mean of the last 5 steps (one batch of 16 is a noisy estimate).
    tail = sum(losses[s] for s in range(LOSSY_STEPS - 5, LOSSY_STEPS)) / 5
    ref_tail = sum(reference.losses[-5:]) / 5
    assert ref_tail < reference.losses[0] * 0.9  # it did train
    assert abs(tail - ref_tail) <= 0.02 * ref_tail, (tail, ref_tail)
    # The codecs did compress: edge 0 carries half the bytes of float32, edge 1 about a quarter.
    middle = runs[1].final
    assert middle.raw_bytes_sent > 0 and middle.bytes_sent < 0.5 * middle.raw_bytes_sent
    # The summary's per-edge, per-direction numbers, from the stages' per-edge counters.
    summary = JobSummary(job.job_id, LOSSY_STEPS)
    summary.edge_traffic = {run.final.stage: {t.edge: t for t in run.final.edges} for run in runs}
    summary.fill_chain_wan(chain_edges(job))
    assert list(summary.wan_edges) == ["reader->mixer1", "mixer1->head"]
    frames = LOSSY_STEPS * job.spec.data.micro_batches
    for edge, ratio, ends in (("reader->mixer1", 2.0, ("a", "b")), ("mixer1->head", 4.0, ("b", "c"))):
        for direction, (source, target) in (("forward", ends), ("backward", ends[::-1])):
            wan = summary.wan_edges[edge][direction]
            assert (wan["from"], wan["to"], wan["frames"]) == (source, target, frames), (edge, wan)
            assert wan["payload_bytes"] == wan["payload_bytes_received_by_peer"] > 0, (edge, wan)
            assert wan["frames_received_by_peer"] == frames
            assert wan["raw_bytes"] == frames * 8 * 32 * 4  # micro-batches of 8 x width 32, float32
            assert wan["compression_ratio"] == pytest.approx(ratio, rel=0.02), (edge, direction, wan)
    assert summary.to_json()["wan_edges"] == summary.wan_edges


def refused(fields: dict[str, Any]) -> str:
    base = load_spec(EXAMPLE).spec.model_dump(mode="json", by_alias=True)
    base.update(fields)
    with pytest.raises(SpecError) as caught:
        load_spec(base, base_dir=EXAMPLE.parent)
    return str(caught.value)


def test_bad_chains_are_refused_naming_the_field(tmp_path: Path) -> None:
    three = chain_fields(3)
    backwards = {**three, "edges": [three["edges"][0], {"from": "head", "to": "mixer1"}]}
    assert "edges.1: must go from stage 1 to stage 2 (mixer1 -> head), got head -> mixer1" in refused(
        backwards
    )
    short = {**three, "edges": three["edges"][:1]}
    assert "edges: 3 stages form a chain of 2 edge(s) (stage K -> stage K+1), got 1" in refused(short)
    same_cluster = chain_fields(3)
    same_cluster["stages"][2]["cluster"] = "a"
    assert "each stage must run in a different cluster" in refused(same_cluster)
    assert "stages: List should have at most 8 items" in refused(chain_fields(9))
    one_way = {**three, "pipeline": {"mode": "one_way"}}
    assert "pipeline.mode: one_way (ELECTRA: generator -> discriminator) is a two-stage shape" in refused(
        one_way
    )
    (tmp_path / "empty.py").write_text("import torch\n")
    no_build = chain_fields(3)
    no_build["stages"][1]["module"] = str(tmp_path / "empty.py")
    assert "stages.1.module: " in refused(
        no_build
    ) and "must define build, load_examples, collate (a middle (chain) stage defines build" in refused(
        no_build
    )


def test_the_trainer_refuses_a_middle_stage_without_its_second_edge_and_an_end_stage_with_one() -> None:
    job = chain_job(3)
    middle = job.stage_spec("mixer1")
    assert middle.program.role == "middle" and middle.program.stage_count == 3
    assert (middle.edge, middle.peer_cluster) == ("reader->mixer1", "a")
    assert (middle.downstream_edge.edge, middle.downstream_edge.peer_cluster) == ("mixer1->head", "c")
    middle.ClearField("downstream_edge")
    with pytest.raises(InvalidRequestError, match=r"downstream_edge\.edge is required for a middle stage"):
        validate_stage_spec(middle)
    first = job.stage_spec("reader")
    assert (first.program.role, first.edge, first.peer_cluster) == ("upstream", "reader->mixer1", "b")
    first.downstream_edge.edge = "x->y"
    with pytest.raises(InvalidRequestError, match="downstream_edge: only a middle stage"):
        validate_stage_spec(first)
    last = job.stage_spec("head")
    assert (last.program.role, last.edge, last.peer_cluster) == ("downstream", "mixer1->head", "b")
    last.program.stage_count = 9
    with pytest.raises(InvalidRequestError, match=r"program.stage_count 9 must be in 2..8"):
        validate_stage_spec(last)


def test_a_two_stage_job_keeps_its_stage_specs() -> None:
    """Two stages: no chain fields but the peer's cluster (what a multi-peer switch routes by)."""
    job = chain_job(2)
    first, last = job.stage_spec("reader"), job.stage_spec("head")
    assert first.program.stage_count == last.program.stage_count == 0
    assert not first.HasField("downstream_edge") and not last.HasField("downstream_edge")
    assert (first.peer_cluster, last.peer_cluster) == ("b", "a")
    assert first.edge == last.edge == "reader->head"


def vanish(run: StageRun) -> None:
    """Kill the stage as a dead process would: its edge ends disappear without a close, then it stops."""
    for edge in (run.runner.edge, run.runner.down):
        if edge is not None:
            transport = edge.session.transport
            assert isinstance(transport, MemoryTransport)
            transport.vanish()
    run.runner.cancel()  # the "dead" runner's thread must not train on (its closes go nowhere)
    finish(run, 30)


@pytest.fixture(scope="module")
def recovery_reference() -> UnsplitResult:
    return run_unsplit(chain_job(3).loaded)


@pytest.mark.parametrize("dead", [1, 2, 0], ids=["middle-restarts", "last-restarts", "first-restarts"])
def test_a_restarted_stage_of_a_chain_resumes_every_stage_at_the_common_checkpoint(
    recovery_reference: UnsplitResult, tmp_path: Path, dead: int
) -> None:
    job = chain_job(3)
    links = [MemoryLink() for _ in job.spec.edges]
    runs = [chain_runner(job, i, tmp_path, links, SETTINGS) for i in range(3)]
    for run in runs:
        run.runner.start()
    wait_for_step(runs[dead], 5)
    vanish(runs[dead])
    runs[dead] = chain_runner(job, dead, tmp_path, links, SETTINGS, epoch=1)
    runs[dead].runner.start()
    for run in runs:
        finish(run, 180)
    check_equals_unsplit(runs, recovery_reference, STEPS)
    resumed = {run.final.resumed_from_step for run in runs}
    assert len(resumed) == 1 and resumed.pop() >= 2  # one checkpoint every stage held, not the start
    for run in runs:
        assert run.final.epoch == 1
        assert RECOVERING in [status.state for status in run.board]


def test_an_outage_on_one_edge_recovers_the_whole_chain(
    recovery_reference: UnsplitResult, tmp_path: Path
) -> None:
    job = chain_job(3)
    links = [MemoryLink() for _ in job.spec.edges]
    runs = [chain_runner(job, i, tmp_path, links, SHORT_OUTAGE) for i in range(3)]
    for run in runs:
        run.runner.start()
    wait_for_step(runs[2], 3)
    links[1].cut("cable unplugged")  # mixer1 -> head only
    wait_for(
        lambda: all(run.final.state == RECOVERING for run in runs[1:]),
        30,
        "the middle and the last to recover",
    )
    links[1].restore()
    for run in runs:
        finish(run, 180)
    check_equals_unsplit(runs, recovery_reference, STEPS)
    assert {run.final.epoch for run in runs} == {1}  # the first stage followed into the new epoch


def test_a_failing_middle_stage_fails_the_whole_chain_at_once_with_the_reason(tmp_path: Path) -> None:
    broken = tmp_path / "broken_mixer.py"
    source = (EXAMPLE.parent / "mixer.py").read_text()
    calls = "CALLS = [0]\n\n\ndef forward(model, received, batch):\n    CALLS[0] += 1\n"
    explode = (
        "    if CALLS[0] > 4:\n        raise RuntimeError('mixer exploded')\n    return model(received)\n"
    )
    broken.write_text(f"{source}\n\n{calls}{explode}")
    spec = chain_job(3).spec.model_dump(mode="json", by_alias=True)
    spec["stages"][1]["module"] = str(broken)
    job = ProgramJob(load_spec(spec, base_dir=EXAMPLE.parent))
    started = time.monotonic()
    runs = run_chain(job, tmp_path)
    assert time.monotonic() - started < 60  # not a receive timeout (300 s)
    for run in runs:
        assert run.final.state == trainer_pb2.STAGE_STATE_FAILED, (run.final.stage, run.final.message)
    assert "mixer exploded" in runs[1].final.message
    for run in (runs[0], runs[2]):
        assert "mixer exploded" in run.final.message, run.final.message


def test_cancelling_a_middle_stage_ends_its_neighbours(tmp_path: Path) -> None:
    job = chain_job(3, steps=10_000)
    links = [MemoryLink() for _ in job.spec.edges]
    runs = [chain_runner(job, i, tmp_path, links, SETTINGS) for i in range(3)]
    for run in runs:
        run.runner.start()
    wait_for_step(runs[1], 2)
    runs[1].runner.cancel()
    for run in runs:
        finish(run, 60)
    for run in runs:  # the neighbours as in a two-stage job: "the other cluster's stage was cancelled"
        assert run.final.state == trainer_pb2.STAGE_STATE_CANCELLED, (run.final.stage, run.final.message)
    assert runs[0].final.message == runs[2].final.message == PEER_CANCELLED


def test_a_hot_started_chain_continues_the_unsplit_run_exactly(tmp_path: Path) -> None:
    """The paper's Figure 8 on a chain: 4 steps unsplit here, the rest split (each stage: its state)."""
    loaded = chain_job(3).loaded
    job, _ = ProgramJob.hot_started(loaded, 4)
    assert sorted(job.initial_states) == ["head", "mixer1", "reader"]
    runs = run_chain(job, tmp_path)
    assert min(runs[-1].losses()) == 4  # the split run began where the unsplit one stopped
    check_equals_unsplit(runs, run_unsplit(loaded), STEPS, start=4)
