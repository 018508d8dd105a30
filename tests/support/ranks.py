"""Cluster ranks as the trainer runs them: the rank store behind its mutual-TLS gate, with the worker
identity a rank needs to get through (``services/trainer/runtime/rank_gate.py``)."""

from __future__ import annotations

import os

from nebula_common.pki import PkiLayout
from nebula_common.pki.service_identity import ensure_service_certificates, issue_service_certificate
from nebula_common.rpc.internal_tls import PLAINTEXT_ENV
from services.trainer.runtime.rank_gate import RankTls
from services.trainer.runtime.rank_sources import ClusterRanks


def gated_ranks(
    pki: PkiLayout, world: int, listen: str = "127.0.0.1:0"
) -> tuple[ClusterRanks, dict[str, str]]:
    """Cluster a's rank store for ``world`` ranks, and the environment of a worker that may join it."""
    trainer = ensure_service_certificates(pki.root, "a", ("trainer",))["trainer"]
    worker = issue_service_certificate(pki.root, "a", "worker")
    ranks = ClusterRanks(listen, world=world, tls=RankTls(trainer, "a"))
    return ranks, worker_env({"NEBULA_WORKER_INTERNAL_TLS_DIR": str(worker.dir)})


def worker_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment for a worker, without the plaintext flag: ranks always use TLS here."""
    return {**{k: v for k, v in os.environ.items() if k != PLAINTEXT_ENV}, **extra}
