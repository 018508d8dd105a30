"""Isolation between accounts on the real deployment (separate processes, real gRPC, real files).

Account X must never see, change or obtain account Y's data, jobs or checkpoints:

* data (nebula-data): read, list, grant, revoke, list grants, delete, download of Y's dataset by X
  are refused and audited; a grantee reads batches but never downloads, deletes or re-grants; a
  revocation stops the very next batch; imports cannot escape the caller's inbox;
* jobs (trainer, switch): watch, cancel, list checkpoints, resume from, re-use the id of, and attach
  a relay edge to Y's job are refused, and Y's job is unaffected.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from nebula_common.data import GrantedBatchSource
from nebula_common.errors import AuthenticationError, InvalidRequestError, PermissionDeniedError
from nebula_common.jobspec import load_spec
from nebula_common.launcher import LocalDeployment
from nebula_common.proto.nebula.v1 import (
    audit_pb2,
    audit_pb2_grpc,
    relay_pb2,
    relay_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from nebula_common.rpc import bearer_metadata
from nebula_common.rpc.framing import LINK_FRAMING_VERSION
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.data_client import DataClient, DatasetNotFoundError
from nebula_common.sdk.jobs import ProgramJob
from tests.support.accounts import admin_token, create_account
from tests.support.internal import service_channel, user_channel
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

NUMBERS_SPEC = Path(__file__).resolve().parents[2] / "nebula_common/jobspec/builtin/numbers/job.yaml"
RECORDS = [{"id": i, "text": f"private sentence {i}"} for i in range(50)]


def _account(deployment: LocalDeployment, cluster: str, prefix: str) -> tuple[str, str]:
    """A fresh account of ``cluster`` (created by its admin): (username, token)."""
    username = f"{prefix}-{secrets.token_hex(3)}"
    password = create_account(deployment, cluster, username)
    with AuthClient(deployment.endpoints(cluster).auth) as auth:
        return username, auth.login(username, password).token


def _data_audit(deployment: LocalDeployment, cluster: str, **query: Any) -> list[dict[str, Any]]:
    with user_channel(deployment.data_address(cluster), "data") as channel:
        reply = audit_pb2_grpc.AuditLogStub(channel).Query(
            audit_pb2.AuditQuery(**query),
            metadata=bearer_metadata(admin_token(deployment, cluster)),
            timeout=10,
        )
    return [json.loads(r) for r in reply.records_json]


@pytest.fixture(scope="module")
def tenants(deployment: LocalDeployment) -> Iterator[dict[str, Any]]:
    """Owner Y with a dataset, reader R granted on it, stranger X with nothing; all of cluster a."""
    address = deployment.data_address("a")
    (owner, owner_token), (reader, reader_token), (stranger, stranger_token) = (
        _account(deployment, "a", p) for p in ("owner", "reader", "stranger")
    )
    clients = {
        "owner": DataClient(address, owner_token),
        "reader": DataClient(address, reader_token),
        "stranger": DataClient(address, stranger_token),
    }
    info = clients["owner"].upload_records("corpus", RECORDS)
    assert (info.owner, info.name, info.records) == (owner, "corpus", len(RECORDS))
    clients["owner"].grant("corpus", reader)
    yield {
        "address": address,
        "names": {"owner": owner, "reader": reader, "stranger": stranger},
        "tokens": {"owner": owner_token, "reader": reader_token, "stranger": stranger_token},
        "clients": clients,
        "dataset": f"{owner}/corpus",
    }
    for client in clients.values():
        client.close()


def _refusal_texts(deployment: LocalDeployment, calls: dict[str, Callable[[], Any]]) -> dict[str, str]:
    """Run each call, require a refusal, and return its message (checked for leaked paths)."""
    texts = {}
    for what, call in calls.items():
        with pytest.raises((DatasetNotFoundError, PermissionDeniedError)) as caught:
            call()
        texts[what] = str(caught.value)
        assert str(deployment.run_dir) not in texts[what], f"{what} leaked a server path"
    return texts


def test_a_stranger_can_do_nothing_with_another_accounts_dataset(
    deployment: LocalDeployment, tenants: dict[str, Any], tmp_path: Path
) -> None:
    stranger, owner = tenants["clients"]["stranger"], tenants["clients"]["owner"]
    dataset, reader = tenants["dataset"], tenants["names"]["reader"]
    texts = _refusal_texts(
        deployment,
        {
            "read": lambda: stranger.read_batch(dataset, [0, 1]),
            "list grants": lambda: stranger.grants(dataset),
            "delete": lambda: stranger.delete(dataset),
            "download": lambda: stranger.download(dataset, tmp_path / "stolen.jsonl"),
            # Grant and revoke only ever name the caller's own namespace: "corpus" is not the stranger's.
            "grant": lambda: stranger.grant("corpus", tenants["names"]["stranger"] + "x"),
            "revoke": lambda: stranger.revoke("corpus", reader),
        },
    )
    # Absent and forbidden look the same: the refusal does not confirm the dataset exists.
    assert all(
        t.startswith("no dataset ") and t.endswith("visible to this account") for t in texts.values()
    ), texts
    assert not (tmp_path / "stolen.jsonl").exists()
    owned, granted = stranger.list()
    assert owned == [] and granted == []
    # Nothing changed for the owner: dataset intact, the one grant still there.
    assert [g.grantee for g in owner.grants("corpus")] == [reader]
    assert owner.read_batch("corpus", [3]) == [RECORDS[3]]

    refused = _data_audit(deployment, "a", account=tenants["names"]["stranger"], event="data.")
    assert {r["event"] for r in refused if r["outcome"] == "refused"} >= {
        "data.read",
        "data.list_grants",
        "data.delete",
        "data.download",
        "data.grant",
        "data.revoke",
    }


def test_a_grantee_gets_batches_only_and_loses_them_on_the_next_batch_after_revoke(
    deployment: LocalDeployment, deployment_dir_guard: None, tenants: dict[str, Any], tmp_path: Path
) -> None:
    owner_name, reader_name = tenants["names"]["owner"], tenants["names"]["reader"]
    owner, reader = tenants["clients"]["owner"], tenants["clients"]["reader"]
    address, dataset = tenants["address"], tenants["dataset"]
    owner.upload_records("revocable", RECORDS)
    owner.grant("revocable", reader_name)

    with GrantedBatchSource(address, tenants["tokens"]["reader"], f"{owner_name}/revocable") as source:
        assert len(source) == len(RECORDS)
        assert source.batch([7, 2, 7]) == [RECORDS[7], RECORDS[2], RECORDS[7]]
        _, granted = reader.list()
        assert {d.ref for d in granted} >= {dataset, f"{owner_name}/revocable"}
        # A grant is for batches: the file, its grants and its deletion stay the owner's.
        _refusal_texts(
            deployment,
            {
                "download": lambda: reader.download(f"{owner_name}/revocable", tmp_path / "copy.jsonl"),
                "delete": lambda: reader.delete(f"{owner_name}/revocable"),
                "list grants": lambda: reader.grants(f"{owner_name}/revocable"),
            },
        )
        assert owner.revoke("revocable", reader_name) is True
        started = time.monotonic()
        with pytest.raises(DatasetNotFoundError):
            source.batch([0])
        assert time.monotonic() - started < 2.0
    assert owner.revoke("revocable", reader_name) is False  # nothing left to revoke

    records = _data_audit(deployment, "a", event="data.")
    mine = [r for r in records if r["details"].get("dataset") == f"{owner_name}/revocable"]
    events = [(r["event"], r["outcome"], r["account"]) for r in mine]
    assert ("data.grant", "ok", owner_name) in events
    assert ("data.revoke", "ok", owner_name) in events
    reads = [r for r in mine if r["event"] == "data.read" and r["outcome"] == "ok"]
    assert reads and all(r["account"] == reader_name and r["details"]["via_grant"] for r in reads)
    assert ("data.read", "refused", reader_name) in events  # the batch after the revocation
    assert [e for e in events if e[0] == "data.read"][-1] == ("data.read", "refused", reader_name)


@pytest.fixture()
def deployment_dir_guard(deployment: LocalDeployment) -> Iterator[None]:
    """Fail if anything under a reader's reach appears in the run dir outside the data service's tree."""
    before = {p for p in deployment.run_dir.rglob("*.jsonl")}
    yield
    after = {p for p in deployment.run_dir.rglob("*.jsonl")}
    data_root = deployment.run_dir / "a" / "data"
    leaked = sorted(str(p) for p in after - before if data_root not in p.parents)
    assert leaked == [], f"dataset content copied outside the data service: {leaked}"


def test_imports_stay_inside_the_callers_inbox(deployment: LocalDeployment, tenants: dict[str, Any]) -> None:
    stranger_name, owner_name = tenants["names"]["stranger"], tenants["names"]["owner"]
    stranger = tenants["clients"]["stranger"]
    data_root = deployment.run_dir / "a" / "data" / "accounts"
    inbox = data_root / stranger_name / "inbox"
    inbox.mkdir(parents=True, exist_ok=True)
    (inbox / "mine.jsonl").write_text('{"x": 1}\n{"x": 2}\n')
    assert stranger.import_file("mine", "mine.jsonl").records == 2
    # A symlink into the owner's namespace, a path climbing out, an absolute path: all refused.
    victim = data_root / owner_name / "datasets" / "corpus" / "records.jsonl"
    assert victim.exists()
    os.symlink(victim, inbox / "steal.jsonl")
    for bad in ("steal.jsonl", f"../../{owner_name}/datasets/corpus/records.jsonl", str(victim)):
        with pytest.raises(InvalidRequestError):
            stranger.import_file("stolen", bad)
    owned, _ = stranger.list()
    assert [d.name for d in owned] == ["mine"]


def test_tokens_of_the_other_cluster_or_none_are_refused(
    deployment: LocalDeployment, tenants: dict[str, Any]
) -> None:
    _, foreign_token = _account(deployment, "b", "foreign")
    with DataClient(tenants["address"], foreign_token) as foreign, pytest.raises(AuthenticationError):
        foreign.read_batch(tenants["dataset"], [0])
    with pytest.raises(AuthenticationError):
        DataClient(tenants["address"], "")


# ---------------------------------------------------------------------------------------------- jobs


def _numbers_job(steps: int) -> ProgramJob:
    loaded = load_spec(NUMBERS_SPEC, {"steps": steps, "data.batch_size": 16})
    return ProgramJob(loaded)


@pytest.fixture(scope="module")
def victim_jobs(deployment: LocalDeployment) -> Iterator[dict[str, Any]]:
    """Y's finished two-cluster job (with checkpoints) and Y's job still waiting for its peer."""
    sessions = {}
    for cluster in ("a", "b"):
        name, token = _account(deployment, cluster, "victim")
        sessions[cluster] = ClusterSession(deployment.endpoints(cluster), token, name)
    finished = _numbers_job(steps=2)
    handle = submit_job(finished, sessions)
    for update in handle.updates():
        if update.status.state in (trainer_pb2.STAGE_STATE_FAILED, trainer_pb2.STAGE_STATE_CANCELLED):
            pytest.fail(f"victim's job did not finish: {update.status.message}")
    assert sessions["a"].list_checkpoints(finished.job_id, "encoder") == [2]
    # Only cluster a's stage: it attaches its edge at the switch and waits for a peer that never comes.
    waiting = _numbers_job(steps=50)
    sessions["a"].assign(waiting.stage_spec("encoder"))
    # Its stage process starts, then opens the edge: only then is the route the victim's.
    switch_log = deployment.log_dir / "switch-a.log"
    wait_for(
        lambda: any(
            '"edge opened"' in line and waiting.job_id in line
            for line in switch_log.read_text(errors="replace").splitlines()
        ),
        60.0,
        f"switch a opened the edge of the victim's waiting job {waiting.job_id}",
        interval=0.1,
    )
    yield {"sessions": sessions, "finished": finished, "waiting": waiting}
    sessions["a"].cancel(waiting.job_id)
    for session in sessions.values():
        session.close()


def _code(call: Callable[[], Any]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code()


def test_another_accounts_jobs_and_checkpoints_are_out_of_reach(
    deployment: LocalDeployment, victim_jobs: dict[str, Any]
) -> None:
    finished, waiting = victim_jobs["finished"], victim_jobs["waiting"]
    victim = victim_jobs["sessions"]["a"]
    _, token = _account(deployment, "a", "intruder")
    meta = bearer_metadata(token)
    with user_channel(deployment.endpoints("a").trainer, "trainer") as channel:
        trainer = trainer_pb2_grpc.TrainerStub(channel)

        def watch(job_id: str) -> Any:
            return next(iter(trainer.WatchStage(trainer_pb2.WatchStageRequest(job_id=job_id), metadata=meta)))

        assert _code(lambda: watch(waiting.job_id)) == grpc.StatusCode.NOT_FOUND
        assert _code(lambda: watch(finished.job_id)) == grpc.StatusCode.NOT_FOUND
        cancel = trainer_pb2.CancelStageRequest(job_id=waiting.job_id)
        assert (
            _code(lambda: trainer.CancelStage(cancel, metadata=meta, timeout=10)) == grpc.StatusCode.NOT_FOUND
        )
        listing = trainer_pb2.ListCheckpointsRequest(job_id=finished.job_id, stage="encoder")
        assert (
            _code(lambda: trainer.ListCheckpoints(listing, metadata=meta, timeout=10))
            == grpc.StatusCode.NOT_FOUND
        )
        # Resuming from Y's checkpoint would load Y's weights into X's job.
        resume = ProgramJob(_numbers_job(steps=3).loaded, resume_job_id=finished.job_id, resume_step=2)
        request = trainer_pb2.AssignStageRequest(spec=resume.stage_spec("encoder"))
        assert (
            _code(lambda: trainer.AssignStage(request, metadata=meta, timeout=30))
            == grpc.StatusCode.FAILED_PRECONDITION
        )

    # The relay: X cannot attach to (and so receive the frames of) an edge of Y's job, not even
    # through a trainer of the cluster (only a trainer's certificate may open edges at all).
    with service_channel(deployment, "a", "switch", as_role="trainer") as channel:
        relay = relay_pb2_grpc.RelayStub(channel)
        opening = relay_pb2.EdgeMessage(
            open=relay_pb2.EdgeOpen(
                job_id=waiting.job_id, edge=waiting.edge, link_framing=LINK_FRAMING_VERSION
            )
        )
        stream = relay.OpenEdge(iter([opening]), metadata=meta, timeout=10)
        assert _code(lambda: next(iter(stream))) == grpc.StatusCode.ALREADY_EXISTS

    # Y's job is untouched by all of that: still there, not cancelled, checkpoints still Y's.
    status = next(iter(victim.watch(waiting.job_id)))
    assert status.state in (trainer_pb2.STAGE_STATE_PENDING, trainer_pb2.STAGE_STATE_RUNNING)
    assert victim.list_checkpoints(finished.job_id, "encoder") == [2]
