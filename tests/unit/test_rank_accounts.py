"""The accounts the operator names compute on the cluster's ranks; every stage is boxed either way.

A stage on cluster ranks is driven from its stage box on the trainer (``stage_ranks``) with its
cluster ranks, and each rank's part runs in a box on its worker. An account the operator did not name
(``NEBULA_TRAINER_RANKS_ACCOUNTS``, default every account) computes in its stage box alone, is told so
in the submission's answer and the audit, and a bad entry in the setting is named at start-up. The
hostile side runs for real in ``make smoke-ranks-containers`` (``docker/smoke_ranks.py``: a stage
written to break out, its driver in trainer-a's box on the ranks) and ``test_stage_ranks.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from nebula_common.errors import InvalidRequestError
from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.config import TrainerSettings
from services.trainer.rank_accounts import RankAccounts, may_use_ranks
from services.trainer.runtime.rank_sources import ClusterRanks
from services.trainer.sandbox import Confinement
from services.trainer.servicer import TrainerServicer
from services.trainer.stage_process import StageProcess
from tests.support.trainer_audit import trainer_audit


def test_entries_are_names_prefixes_or_everyone() -> None:
    accounts = RankAccounts.parse(" alice, team-* ,,")
    assert accounts.entries == ("alice", "team-*")
    assert accounts.includes("alice") and accounts.includes("team-ml") and accounts.includes("team-")
    assert not any(accounts.includes(name) for name in ("alice2", "teamx", "mallory"))
    assert RankAccounts.parse("*").includes("anyone")
    nobody = RankAccounts.parse("")
    assert not nobody.includes("alice") and "no account" in nobody.describe()


@pytest.mark.parametrize("entry", ["Alice", "a b", "team*x", "../etc", "-x", "*team", "x" * 65])
def test_a_bad_entry_is_named(entry: str) -> None:
    with pytest.raises(ValueError) as refused:
        RankAccounts.parse(f"alice,{entry}")
    assert "NEBULA_TRAINER_RANKS_ACCOUNTS" in str(refused.value) and repr(entry) in str(refused.value)


def test_the_trainer_names_a_bad_setting_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEBULA_TRAINER_CLUSTER_ID", "a")
    monkeypatch.setenv("NEBULA_TRAINER_AUTH_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("NEBULA_TRAINER_SWITCH_ADDRESS", "127.0.0.1:2")
    monkeypatch.setenv("NEBULA_TRAINER_RANKS_ACCOUNTS", "alice,Bob")
    with pytest.raises(ValidationError) as refused:
        TrainerSettings()
    assert "'Bob'" in str(refused.value)
    monkeypatch.setenv("NEBULA_TRAINER_RANKS_ACCOUNTS", "alice,team-*")
    assert TrainerSettings().ranks_accounts == "alice,team-*"
    monkeypatch.delenv("NEBULA_TRAINER_RANKS_ACCOUNTS")
    assert RankAccounts.parse(TrainerSettings().ranks_accounts).includes("anyone")  # default: everyone


def _spec(job_id: str, **program: object) -> trainer_pb2.StageSpec:
    return trainer_pb2.StageSpec(
        job_id=job_id, stage="encoder", program=trainer_pb2.ProgramStage(role="upstream", **program)
    )


def test_one_way_senders_and_dataset_readers_never_use_ranks() -> None:
    assert may_use_ranks(_spec("j"))
    assert not may_use_ranks(_spec("j", mode="one_way"))
    assert not may_use_ranks(_spec("j", dataset="corpus"))


@pytest.fixture
def servicer(tmp_path: Path) -> Iterator[TrainerServicer]:
    audit = trainer_audit(tmp_path)
    ranks = ClusterRanks("127.0.0.1:0", world=2)
    trainer = TrainerServicer(
        "a",
        "127.0.0.1:1",
        tmp_path / "trainer",
        audit,
        cluster_ranks=ranks,
        ranks_accounts=RankAccounts.parse("alice,team-*"),
        confinement=Confinement("landlock", "no bubblewrap", landlock_abi=7),
    )
    yield trainer
    ranks.close()
    trainer.close()
    audit.close()


def test_only_named_accounts_stages_run_on_the_ranks(servicer: TrainerServicer) -> None:
    for owner in ("alice", "team-ml"):
        runner = servicer._make_runner(_spec(f"job-{owner}"), "token", owner)
        assert isinstance(runner, StageProcess) and runner._cluster_ranks is servicer.where.cluster_ranks
        assert servicer.where.describe(_spec("j"), owner).startswith(
            "the cluster's 2 ranks, each rank's part boxed, driven from a landlock box on this trainer"
        )
    boxed = servicer._make_runner(_spec("job-mallory"), "token", "mallory")
    assert isinstance(boxed, StageProcess) and boxed._cluster_ranks is None
    placement = servicer.where.describe(_spec("j"), "mallory")
    assert placement.startswith("landlock box on this trainer")
    assert "NEBULA_TRAINER_RANKS_ACCOUNTS does not name this account" in placement
    # A stage that never computes on ranks runs boxed whoever submits it.
    reader = servicer._make_runner(_spec("job-reader", dataset="corpus"), "token", "alice")
    assert isinstance(reader, StageProcess)
    assert servicer.where.describe(_spec("j", dataset="corpus"), "alice") == "landlock box on this trainer"


def test_an_unnamed_account_gets_its_box_s_limits(servicer: TrainerServicer) -> None:
    # Landlock denies a stage TCP, so replicas that would meet over it are refused for a boxed stage...
    with pytest.raises(InvalidRequestError, match=r"program\.replicas 2"):
        servicer.where.check_allows(_spec("j", replicas=2), "mallory")
    # ...while a named account's stage computes on the ranks, where replicas do not apply.
    servicer.where.check_allows(_spec("j", replicas=2), "alice")
