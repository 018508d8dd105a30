"""Which accounts' stages compute on the cluster's ranks (``NEBULA_TRAINER_RANKS_ACCOUNTS``).

A stage on cluster ranks (``NEBULA_TRAINER_RANKS_LISTEN``) is driven from its stage box on the trainer
(``stage_ranks``) and computed in boxes on long-lived worker processes (``rank_box``): the job's code
is confined either way. The ranks run one stage at a time, so the operator may keep them for some
accounts: every other account's stage computes in its stage box on this trainer alone. The default
names every account (``*``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nebula_common.proto.nebula.v1 import trainer_pb2

SETTING = "NEBULA_TRAINER_RANKS_ACCOUNTS"
_ENTRY = re.compile(r"\*|[a-z0-9][a-z0-9._-]{0,63}\*?")
"""An account name (auth's rule, shorter names allowed for prefixes), a prefix ending in ``*``, or ``*``."""


@dataclass(frozen=True)
class RankAccounts:
    """The accounts whose stages compute on the cluster's ranks: exact names and ``prefix*`` entries."""

    entries: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> RankAccounts:
        """From the setting's comma-separated list; a bad entry raises ``ValueError`` naming it."""
        entries = tuple(part.strip() for part in text.split(",") if part.strip())
        for entry in entries:
            if _ENTRY.fullmatch(entry) is None:
                raise ValueError(
                    f"{SETTING}: {entry!r} is neither an account name (a-z, 0-9, '.', '_', '-'), a "
                    "prefix ending in '*', nor '*'"
                )
        return cls(entries)

    def includes(self, account: str) -> bool:
        for entry in self.entries:
            if entry == account or (entry.endswith("*") and account.startswith(entry[:-1])):
                return True
        return False

    def describe(self) -> str:
        if not self.entries:
            return f"no account ({SETTING} is empty): every stage computes in its box on this trainer alone"
        if "*" in self.entries:
            return "every account"
        named = ", ".join(self.entries)
        return f"accounts {named} only; every other account's stage computes in its box here"


def may_use_ranks(spec: trainer_pb2.StageSpec) -> bool:
    """Whether a stage computes on rank processes when the trainer has them: not a one-way sender
    (it has no gradient to sum) and not a stage that reads a dataset (one reader of its batches)."""
    program = spec.program
    one_way_sender = program.role == "upstream" and program.mode == "one_way"
    return not (one_way_sender or program.dataset)


__all__ = ["SETTING", "RankAccounts", "may_use_ranks"]
