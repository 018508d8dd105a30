"""docker/smoke_secrets.py's verdict on a listing: each rule it checks in compose can fail."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

_spec = importlib.util.spec_from_file_location(
    "smoke_secrets", Path(__file__).resolve().parents[2] / "docker" / "smoke_secrets.py"
)
assert _spec is not None and _spec.loader is not None
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
violations = _module.violations

OWN = "/etc/nebula/internal-tls/service.key"


def _listing(**extra: list[dict[str, str]]) -> dict[str, dict[str, Any]]:
    listing: dict[str, dict[str, Any]] = {
        name: {"uid": 10001, "secrets": [{"path": OWN, "kind": "private key", "sha256": f"own-{name}"}]}
        for name in ("auth-a", "switch-a", "trainer-a")
    }
    for name, secrets in extra.items():
        listing[name.replace("_", "-")]["secrets"] += secrets
    return listing


CAS = {"ca-a": "a", "ca-b": "b"}


def test_a_clean_listing_passes() -> None:
    listing = _listing(
        auth_a=[{"path": "/etc/nebula/admin/admin-password", "kind": "password", "sha256": "pw"}]
    )
    assert violations(listing, CAS, {"pw": "auth-a"}) == []


def test_every_rule_can_fail() -> None:
    shared = {"path": "/pki/a/switch.key", "kind": "private key", "sha256": "wan"}
    listing = _listing(
        trainer_a=[
            {"path": "/pki/a/ca.key", "kind": "private key", "sha256": "ca-a"},
            {"path": "/leak/admin-password", "kind": "password", "sha256": "pw"},
            shared,
        ],
        switch_a=[shared],
    )
    listing["auth-a"]["secrets"] = []  # the probe saw nothing of auth's own
    found = violations(listing, CAS, {"pw": "auth-a", "wan": "switch-a"})
    assert any("several containers" in v and "wan" not in v for v in found), found
    assert any("cluster a's CA key is readable" in v for v in found)
    assert any("auth-a's secret is readable in ['trainer-a:/leak/admin-password']" in v for v in found)
    assert any("switch-a's secret is readable" in v and "trainer-a" in v for v in found)
    assert any(v.startswith("auth-a cannot read its own identity key") for v in found)
    assert violations(_listing(), {"ca-a": "a"}, {})[-1].startswith("found 1 CA keys")
