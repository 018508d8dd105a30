"""`codec: auto` on a chain: the advisor per edge, on that edge's real tensors and its own link.

The real in-process advisor (``advise`` with this host's calibration) ranks each edge's codecs
for the link given for that edge; the trial then trains the whole chain (``examples/chain``,
real stream codecs at every cut) with the candidates on that edge. Every stage spec carries
the per-edge codecs and the per-edge choice with its reasons.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from nebula_common.codec.advice import AdviceRequest, AdviceResult, advise
from nebula_common.codec.calibration import Calibrator
from nebula_common.codec.trial import Candidate
from nebula_common.jobspec import load_spec
from nebula_common.jobspec.reference import run_unsplit
from nebula_common.sdk.codec_advice import (
    Advisor,
    LinkProfile,
    needs_advice,
    probe_micro_batch,
    resolve_chain_codecs,
    trial_run,
)
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.report import advice_section
from tests.support.calibration import calibrated
from tests.support.torch_threads import one_torch_thread
from tests.unit.test_stage_chain import EXAMPLE, chain_job

pytestmark = pytest.mark.timeout(300)

SLOW = LinkProfile(bandwidth_mbit=0.1, rtt_ms=10.0)  # 100 kbit/s: the bytes dominate any codec's compute
SLOWER = LinkProfile(bandwidth_mbit=0.05, rtt_ms=30.0)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def calibrator(tmp_path_factory: pytest.TempPathFactory) -> Calibrator:
    return calibrated(
        tmp_path_factory.mktemp("calibration")
    )  # one thread: 0.9 s; two on a busy host: minutes


def with_codecs(job: ProgramJob, *pairs: tuple[str, str]) -> ProgramJob:
    """The same chain with (forward, backward) codecs per edge."""
    spec = job.spec.model_dump(mode="json", by_alias=True)
    for edge, (forward, backward) in zip(spec["edges"], pairs, strict=True):
        edge["codec"] = {"forward": forward, "backward": backward}
    return ProgramJob(load_spec(spec, base_dir=EXAMPLE.parent))


def test_a_chain_trial_with_codec_none_is_the_unsplit_model() -> None:
    """The chain trial's forward/backward through every cut is the unsplit model's when nothing is lossy."""
    job = chain_job(3, steps=4)
    run = trial_run(job, Candidate("none", "none"), 4, edge=1)
    reference = run_unsplit(job.loaded)
    assert run.losses == pytest.approx(reference.losses, abs=1e-5)
    lossy = trial_run(job, Candidate("int8", "int8"), 4, edge=1)
    assert lossy.forward_bytes < 0.4 * run.forward_bytes and lossy.backward_bytes < 0.4 * run.backward_bytes
    probe = probe_micro_batch(job)
    assert probe.edge_shapes == ((8, 16), (8, 16))  # micro-batch of 8, width 16, on both edges


def test_auto_on_a_chain_is_advised_per_edge_for_its_own_link(calibrator: Calibrator) -> None:
    job = with_codecs(chain_job(3, steps=6), ("auto", "fp16"), ("auto", "auto"))  # edge 0: backward fixed
    assert needs_advice(job)
    asked: list[tuple[int, AdviceRequest]] = []

    def advisor(index: int) -> Advisor:  # the real advisor; remembers what each edge asked
        def ask(request: AdviceRequest) -> AdviceResult:
            asked.append((index, request))
            return advise(request, calibrator)

        return ask

    choice = resolve_chain_codecs(job, [advisor(0), advisor(1)], [SLOW, SLOWER])
    assert [index for index, _ in asked] == [0, 1]
    assert [request.bandwidth_bps for _, request in asked] == [0.1e6, 0.05e6]
    assert [request.tensors[0].edge for _, request in asked] == ["reader->mixer1", "mixer1->head"]
    assert all(tuple(t.shape) == (8, 16) for _, request in asked for t in request.tensors)

    codecs = job.edge_codecs()
    assert choice["source"] == "per-edge"
    first, second = choice["edges"]  # in chain order
    assert codecs[0] == (first["forward"], first["backward"]) and first["backward"] == "fp16"
    assert codecs[1] == (second["forward"], second["backward"])
    assert "auto" not in {c for pair in codecs for c in pair}
    # On links this slow a compressing codec wins each auto direction (its trial loss within 2%).
    assert codecs[0][0] != "none" and codecs[1] != ("none", "none"), codecs
    for name, record, link in (("reader->mixer1", first, SLOW), ("mixer1->head", second, SLOWER)):
        assert record["edge"] == name and record["source"] == "codec-service advice"
        assert record["link"] == {"bandwidth_mbit": link.bandwidth_mbit, "rtt_ms": link.rtt_ms}
        assert record["activation_shape"] == [8, 16]
        reasons = record["trial"]["reasons"]
        assert reasons[0].startswith(f"link {link.bandwidth_mbit:g} Mbit/s") and reasons[-1].startswith(
            "chose"
        )

    # Every stage runs its edges' codecs and carries the whole per-edge choice.
    reader, mixer, head = (job.stage_spec(name) for name in ("reader", "mixer1", "head"))
    assert (reader.codec_forward, reader.codec_backward) == codecs[0]
    assert (mixer.codec_forward, mixer.codec_backward) == codecs[0]
    assert (mixer.downstream_edge.codec_forward, mixer.downstream_edge.codec_backward) == codecs[1]
    assert (head.codec_forward, head.codec_backward) == codecs[1]
    assert {s.codec_choice for s in (reader, mixer, head)} == {json.dumps(choice, sort_keys=True)}
    assert job.settings()["edge_codecs"] == {
        "reader->mixer1": list(codecs[0]),
        "mixer1->head": list(codecs[1]),
    }
    page = advice_section(choice)  # the job report: one section per edge, each with its reasons
    assert page.count("<h3>edge ") == 2 and page.count('<ul class="trial">') == 2


def test_a_configured_edge_of_a_chain_keeps_its_codecs(calibrator: Calibrator) -> None:
    assert not needs_advice(chain_job(3, steps=4, codecs=("fp16", "int8")))
    job = with_codecs(chain_job(3, steps=4), ("fp16", "fp16"), ("auto", "int8"))
    choice = resolve_chain_codecs(job, [lambda r: advise(r, calibrator)] * 2, [SLOW, SLOW])
    assert choice["edges"][0] == {
        "edge": "reader->mixer1",
        "source": "configured",
        "forward": "fp16",
        "backward": "fp16",
    }
    assert job.edge_codecs()[0] == ("fp16", "fp16") and job.edge_codecs()[1][1] == "int8"
    with pytest.raises(ValueError, match="one advisor and one link per edge"):
        resolve_chain_codecs(job, [lambda r: advise(r, calibrator)], [SLOW])
