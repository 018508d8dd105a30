"""`codec: auto`: advised once at submission, same concrete codecs in both clusters, recorded and audited."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from nebula_common.audit.signing import SealVerifier
from nebula_common.audit.verify import verify_log
from nebula_common.errors import InvalidRequestError
from nebula_common.jobspec import load_spec
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.launcher import LocalDeployment
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.codec_advice import LinkProfile
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.summary import summarize
from tests.support.torch_threads import one_torch_thread as on_one_thread

# func_only: the first test here may be the first to use the shared deployment; its start is not this
# module's time (185 s of setup at load 31 left the first test 54 s of its 240). The start has its own
# deadlines (each service's health wait).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(240, func_only=True)]


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The submitter's trial trains the job here, in the test process: on one torch thread.

    With torch's default two intra-op threads on a loaded 2-core machine, each trial run of 3 steps
    took 33-48 s at load 30 instead of 3-4 s on one thread (the threads wait on each other), so the
    first test's ~10 trial runs crossed its 240 s limit (146 s of call at load 20). The services
    train on one thread already (``NEBULA_TRAINER_TORCH_THREADS`` defaults to 1).
    """
    with on_one_thread():
        yield


def auto_job(steps: int = 3) -> ProgramJob:
    overrides = {"steps": steps, "edges.0.codec.forward": "auto", "edges.0.codec.backward": "auto"}
    return ProgramJob(load_spec(builtin_spec("numbers"), overrides))


def test_auto_is_resolved_once_used_by_both_clusters_and_audited(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    job = auto_job()
    # The stated link as is (measure_links=False): the reasons below name exactly these numbers.
    handle = submit_job(
        job, sessions, link=LinkProfile(bandwidth_mbit=20.0, rtt_ms=80.0), measure_links=False
    )
    summary = summarize(job, handle)
    assert summary.succeeded, summary.stage_messages

    choice = json.loads(job.codec_choice)
    assert choice["source"] == "codec-service advice"
    assert "auto" not in (job.codec_forward, job.codec_backward)
    assert (choice["forward"], choice["backward"]) == (job.codec_forward, job.codec_backward)
    assert choice["alternatives"]["forward"] and choice["predicted_step_seconds"] > 0
    # The advisor predicted the service's top pairs with the pipelined step model; a 3-step job's
    # trial budget (5% of its predicted time) affords no trial, and the reasons say so.
    trial = choice["trial"]
    assert (trial["forward"], trial["backward"]) == (job.codec_forward, job.codec_backward)
    assert trial["candidates"] and trial["trial_steps"] == 0 and trial["baseline_trial_loss"] is None
    assert trial["reasons"][0].startswith("link 20 Mbit/s, 80 ms RTT")
    assert any(reason.startswith("no trial: its budget") for reason in trial["reasons"]), trial["reasons"]
    assert trial["reasons"][-1].startswith("chose")

    # Both stages report the same concrete codecs and the reasoning behind them.
    for stage, cluster in job.clusters().items():
        final = list(sessions[cluster].watch(job.job_id))[-1]
        assert final.state == trainer_pb2.STAGE_STATE_SUCCEEDED
        assert (final.codec_forward, final.codec_backward) == (job.codec_forward, job.codec_backward)
        assert json.loads(final.codec_choice) == choice, stage

        # ...and each cluster's trainer audited the submission with that choice.
        log = deployment.run_dir / cluster / "trainer" / "audit.log"
        records = [json.loads(line) for line in log.read_text().splitlines()]
        submits = [r for r in records if r["event"] == "job.submit" and r.get("job_id") == job.job_id]
        assert submits and json.loads(submits[-1]["details"]["codec_choice"]) == choice
        assert any(r["event"] == "stage.start" and r.get("job_id") == job.job_id for r in records)
        # The trainer's log is a real hash-chained, sealed audit log: it verifies intact.
        verifier = SealVerifier.from_file(log.parent / "audit-key.pub.pem")
        result = verify_log(log, verifier, require_seal_file=False)
        assert result.ok, (result.first_bad, result.reason)


def test_auto_without_a_link_profile_is_refused_before_anything_starts(
    sessions: dict[str, ClusterSession],
) -> None:
    job = auto_job()
    with pytest.raises(InvalidRequestError, match="codec 'auto' needs the link"):
        submit_job(job, sessions, link=None, measure_links=False)  # nor measured by the switches
    with pytest.raises(Exception, match="no job"):
        list(sessions["a"].watch(job.job_id))


def test_link_profile_rejects_impossible_links() -> None:
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        LinkProfile(bandwidth_mbit=0, rtt_ms=10)
    with pytest.raises(ValueError, match="RTT must be >= 0"):
        LinkProfile(bandwidth_mbit=10, rtt_ms=-1)


def test_the_trainer_refuses_an_unresolved_auto(sessions: dict[str, ClusterSession]) -> None:
    spec = auto_job().stage_spec("encoder")
    with pytest.raises(InvalidRequestError, match="'auto' must be resolved by the submitter"):
        sessions["a"].assign(spec)
