"""A trainer refuses at submission what its stage confinement cannot run, saying why.

Data-parallel replicas of a stage meet over loopback TCP; Landlock (from ABI 4) denies a stage TCP,
so under it a job asking for replicas must be refused with the reason, not fail later with the
kernel's ``EACCES`` from inside torch's store.
"""

from __future__ import annotations

import pytest

from nebula_common.errors import InvalidRequestError
from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.placement import Placement
from services.trainer.rank_accounts import RankAccounts
from services.trainer.sandbox import Confinement


def _check(confinement: Confinement | None, replicas: int, cluster_ranks: object = None) -> None:
    spec = trainer_pb2.StageSpec(job_id="j", stage="s", program=trainer_pb2.ProgramStage(replicas=replicas))
    named = RankAccounts.parse("alice")  # the submitter: on the ranks whenever the trainer has them
    Placement(confinement, cluster_ranks, named).check_allows(spec, "alice")  # type: ignore[arg-type]


def test_landlock_refuses_replicas_naming_the_reason() -> None:
    landlock = Confinement("landlock", "bubblewrap (bwrap) is not installed", landlock_abi=7)
    with pytest.raises(InvalidRequestError) as refused:
        _check(landlock, replicas=2)
    message = str(refused.value)
    assert "program.replicas 2" in message and "bwrap) is not installed" in message
    assert "one replica" in message and "bubblewrap" in message
    _check(landlock, replicas=1)  # one process needs no TCP between ranks


@pytest.mark.parametrize(
    "confinement",
    [
        Confinement("bwrap"),  # the stage's own network namespace: its ranks meet on its loopback
        Confinement("landlock", "old kernel", landlock_abi=3),  # no TCP rule to deny it
        Confinement("process", "neither bubblewrap nor Landlock"),
        None,  # stages on threads (tests)
    ],
)
def test_other_confinements_run_replicas(confinement: Confinement | None) -> None:
    _check(confinement, replicas=2)


def test_stages_on_cluster_ranks_run_replicas_whatever_the_confinement() -> None:
    _check(Confinement("landlock", "no bubblewrap", landlock_abi=7), replicas=2, cluster_ranks=object())
