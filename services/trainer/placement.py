"""Where a stage runs and how it is confined: the trainer's placement policy, decided at submission.

Every stage runs in a stage box on this trainer (``sandbox``), or on a thread of the trainer when it
has no confinement (tests). A stage of an account the operator named (``rank_accounts``) computes on
the cluster's data-parallel ranks: its driver in its box here (``stage_ranks``), each rank's part in a
box on its worker (``rank_box``). The policy also refuses, before anything starts, what the box cannot
run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nebula_common.errors import InvalidRequestError
from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer import landlock
from services.trainer.rank_accounts import SETTING as RANKS_ACCOUNTS_SETTING
from services.trainer.rank_accounts import RankAccounts, may_use_ranks
from services.trainer.runtime.rank_sources import ClusterRanks
from services.trainer.sandbox import Confinement


@dataclass(frozen=True)
class Placement:
    """The trainer's confinement and cluster ranks, and whom it trusts with the ranks."""

    confinement: Confinement | None = None
    """How stages are confined; None runs them on threads of the trainer (tests)."""
    cluster_ranks: ClusterRanks | None = None
    ranks_accounts: RankAccounts = field(default_factory=RankAccounts)
    """Whose stages compute on ``cluster_ranks``; others compute in their box on this trainer alone."""

    def on_cluster_ranks(self, spec: trainer_pb2.StageSpec, owner: str) -> bool:
        """Whether this stage computes on the cluster's ranks: only for an account the operator named
        (they run one stage at a time); any other computes in its stage box alone."""
        return self.cluster_ranks is not None and may_use_ranks(spec) and self.ranks_accounts.includes(owner)

    def boxed(self, spec: trainer_pb2.StageSpec, owner: str) -> bool:
        """Whether the stage runs in a stage process of its own (else on a thread of the trainer)."""
        return self.confinement is not None

    def describe(self, spec: trainer_pb2.StageSpec, owner: str) -> str:
        """Where the stage runs and how it is confined, as its submitter and the audit are told."""
        if self.on_cluster_ranks(spec, owner):
            assert self.cluster_ranks is not None
            box = self.confinement
            driver = "a thread of the trainer" if box is None else f"a {box.mode} box"
            return (
                f"the cluster's {self.cluster_ranks.world} ranks, each rank's part boxed, driven from "
                f"{driver} on this trainer (account named by {RANKS_ACCOUNTS_SETTING})"
            )
        if self.confinement is None:
            return "a thread of the trainer"
        where = f"{self.confinement.mode} box on this trainer"
        if self.cluster_ranks is not None and may_use_ranks(spec):
            where += f" (not on the cluster's ranks: {RANKS_ACCOUNTS_SETTING} does not name this account)"
        return where

    def check_allows(self, spec: trainer_pb2.StageSpec, owner: str) -> None:
        """Refuse what this trainer's confinement cannot run, before anything starts.

        A stage's data-parallel ranks meet over loopback TCP (torch's store and gloo), which Landlock's
        TCP rule denies; under bubblewrap they share the stage's own network namespace instead.
        """
        confinement = self.confinement
        if (
            confinement is not None
            and not self.on_cluster_ranks(spec, owner)  # a driver's box keeps TCP (to its ranks)
            and confinement.mode == "landlock"
            and confinement.landlock_abi >= landlock.TCP_ABI
            and spec.program.replicas > 1
        ):
            raise InvalidRequestError(
                f"program.replicas {spec.program.replicas}: a stage's ranks meet over TCP, which this "
                f"trainer's Landlock confinement denies its stages ({confinement.weaker_because}); "
                "run the stage with one replica, or on a trainer that has bubblewrap"
            )
