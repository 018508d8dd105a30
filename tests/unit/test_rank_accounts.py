"""Only the accounts the operator names run stages on the cluster's ranks, where nothing confines them.

A stage on cluster ranks loads the job's module in the trainer and the workers. An account the
operator did not name (``NEBULA_TRAINER_RANKS_ACCOUNTS``) gets a stage box on the trainer instead, is
told so in the submission's answer and the audit, and a bad entry in the setting is named at start-up.
The hostile side of this boundary runs for real in ``make smoke-ranks-containers``
(``docker/smoke_ranks.py``: an untrusted account's stage written to break out, in trainer-a's box).
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
from services.trainer.runtime.stage import ProgramRunner
from services.trainer.sandbox import Confinement
from services.trainer.servicer import TrainerServicer
from services.trainer.stage_process import StageProcess
from tests.support.trainer_audit import trainer_audit


def test_entries_are_names_prefixes_or_everyone() -> None:
    accounts = RankAccounts.parse(" alice, team-* ,,")
    assert accounts.entries == ("alice", "team-*")
    assert accounts.trusts("alice") and accounts.trusts("team-ml") and accounts.trusts("team-")
    assert not accounts.trusts("alice2") and not accounts.trusts("teamx") and not accounts.trusts("mallory")
    assert RankAccounts.parse("*").trusts("anyone")
    nobody = RankAccounts.parse("")
    assert not nobody.trusts("alice") and "no account" in nobody.describe()


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
    assert not RankAccounts.parse(TrainerSettings().ranks_accounts).entries  # default: nobody


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
        assert isinstance(runner, ProgramRunner) and runner.cluster_ranks is servicer.where.cluster_ranks
        assert servicer.where.describe(_spec("j"), owner).startswith(
            "the cluster's 2 ranks, each rank's part boxed, driven unconfined"
        )
    boxed = servicer._make_runner(_spec("job-mallory"), "token", "mallory")
    assert isinstance(boxed, StageProcess)
    placement = servicer.where.describe(_spec("j"), "mallory")
    assert placement.startswith("landlock box on this trainer")
    assert "NEBULA_TRAINER_RANKS_ACCOUNTS does not name this account" in placement
    # A stage that never computes on ranks runs boxed whoever submits it.
    reader = servicer._make_runner(_spec("job-reader", dataset="corpus"), "token", "alice")
    assert isinstance(reader, StageProcess)
    assert servicer.where.describe(_spec("j", dataset="corpus"), "alice") == "landlock box on this trainer"


def test_an_untrusted_account_gets_its_box_s_limits(servicer: TrainerServicer) -> None:
    # Landlock denies a stage TCP, so replicas that would meet over it are refused for a boxed stage...
    with pytest.raises(InvalidRequestError, match=r"program\.replicas 2"):
        servicer.where.check_allows(_spec("j", replicas=2), "mallory")
    # ...while a trusted account's stage runs on the ranks, where replicas do not apply.
    servicer.where.check_allows(_spec("j", replicas=2), "alice")
