"""Two real switches witness each other's audit heads over the link, on either link carrier.

Each switch sends the head of its audit chain to its peer while the link is up; the peer records it as
``audit.witness`` in its own log. After both stop, each log verifies against the other as witness
(``nebula_common/audit/witness.py``; what a rewrite then looks like: ``tests/unit/test_audit_witness.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nebula_common.audit.witness import check_witnessed
from nebula_common.pki import PkiLayout
from services.switch import witness as witness_module
from tests.integration.test_switch_data_plane import (  # noqa: F401  (clusters: a module fixture)
    Cluster,
    clusters,
    switch_pair,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.mark.parametrize("transport", ["grpc", "records"])
def test_each_switch_witnesses_the_others_audit_log(
    tmp_path: Path,
    pki_ab: PkiLayout,
    clusters: dict[str, Cluster],  # noqa: F811
    transport: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(witness_module, "WITNESS_INTERVAL_S", 0.2)  # 60 s in the product
    with switch_pair(tmp_path, pki_ab, clusters, link_carrier=transport) as pair:
        logs = {c: Path(pair.switches[c].running.audit.path) for c in ("a", "b")}
        log_ids = {c: pair.audit(c, "audit.open")[0]["details"]["log_id"] for c in ("a", "b")}

        def witnessed(witness: str, of: str) -> list[dict[str, object]]:
            return [
                r["details"]
                for r in pair.audit(witness, "audit.witness")
                if r["details"]["log_id"] == log_ids[of] and r["outcome"] == "ok"
            ]

        # Each head recorded makes the witness's own head move: the exchange keeps going both ways.
        wait_for(
            lambda: len(witnessed("b", "a")) >= 3 and len(witnessed("a", "b")) >= 3,
            30,
            "three heads witnessed each way",
        )
        assert all(d["peer"] == "a" for d in witnessed("b", "a"))
        counts = [d["count"] for d in witnessed("b", "a")]
        assert counts == sorted(counts) and len(set(counts)) == len(counts), counts
    for witness, of in (("b", "a"), ("a", "b")):
        result = check_witnessed(logs[of], logs[witness])
        assert result.ok, result.reason
        assert result.witness == f"switch/{witness}" and result.witnessed_through >= 3
