"""docs/settings.md is the settings classes as they are: fresh, and every setting explained."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

from nebula_common.service.settings import unknown_variables

ROOT = Path(__file__).resolve().parents[2]


def test_the_settings_page_is_generated_from_the_settings_classes() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "build_settings_doc.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_every_setting_says_what_it_is_for() -> None:
    rows = [
        line
        for line in (ROOT / "docs" / "settings.md").read_text().splitlines()
        if line.startswith("| `NEBULA_")
    ]
    assert len(rows) >= 100
    cells = [[cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip().strip("|"))] for row in rows]
    assert all(len(row) == 4 for row in cells), [row for row in cells if len(row) != 4]
    undocumented = [row[0] for row in cells if not row[3]]
    assert not undocumented, f"settings without a description (Field(description=...)): {undocumented}"


SETTINGS_CLASSES = {
    "auth": "services.auth.config:AuthSettings",
    "codec": "services.codec.config:CodecSettings",
    "data": "services.data.config:DataSettings",
    "signer": "services.signer.config:SignerSettings",
    "switch": "services.switch.config:SwitchSettings",
    "trainer": "services.trainer.config:TrainerSettings",
}


def _settings_class(service: str) -> type:
    module, _, name = SETTINGS_CLASSES[service].partition(":")
    return getattr(importlib.import_module(module), name)


def test_a_variable_that_names_no_setting_is_found() -> None:
    trainer = _settings_class("trainer")
    environ = {
        "NEBULA_TRAINER_LISTEN": "x",  # a setting
        "nebula_trainer_torch_threads": "1",  # a setting, as pydantic-settings reads it: any case
        "NEBULA_TRAINER_EDGE_TRANSPORT": "grpc",  # no longer read: refused like a typo
        "NEBULA_TRAINER_METRICS_GRACE_S": "0",  # a constant now
        "NEBULA_TRAINER_LISTNE": "x",  # a typo
        "NEBULA_SWITCH_ROUTE_TOMBSTONE_S": "1",  # another service's prefix: not the trainer's business
    }
    assert unknown_variables(trainer, environ) == [
        "NEBULA_TRAINER_EDGE_TRANSPORT",
        "NEBULA_TRAINER_LISTNE",
        "NEBULA_TRAINER_METRICS_GRACE_S",
    ]


def test_the_link_settings_the_carrier_replaced_are_refused_like_typos() -> None:
    switch = _settings_class("switch")
    environ = {
        "NEBULA_SWITCH_LINK_CARRIER": "grpc",
        "NEBULA_SWITCH_LINK_TRANSPORT": "raw",
        "NEBULA_SWITCH_LINK_RECORDS": "sealed",
    }
    old = ["NEBULA_SWITCH_LINK_RECORDS", "NEBULA_SWITCH_LINK_TRANSPORT"]
    assert unknown_variables(switch, environ) == old


def test_a_service_given_an_unknown_variable_refuses_to_start_naming_it() -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("NEBULA_CODEC_")},
        "NEBULA_CODEC_CLUSTER_ID": "a",
        "NEBULA_CODEC_AUTH_ADDRESS": "127.0.0.1:9",
        "NEBULA_CODEC_HANDSHAKE_TIMEOUT_S": "30",  # a constant, no longer a setting
    }
    done = subprocess.run(
        [sys.executable, "-m", "services.codec"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done
    assert done.stdout == ""
    assert done.stderr.strip() == (
        "nebula-codec: invalid configuration: NEBULA_CODEC_HANDSHAKE_TIMEOUT_S: not a setting of this "
        "service (docs/settings.md lists them)"
    )


def test_every_variable_a_deployment_sets_is_a_setting() -> None:
    """Compose files, Kubernetes manifests, the launcher and the benches set only variables that exist,
    so no deployment stops at start (or, worse, sets a value that does nothing)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    pattern = re.compile(r"NEBULA_(AUTH|CODEC|DATA|SWITCH|TRAINER)_[A-Z0-9_]*[A-Z0-9]")
    used: dict[str, set[str]] = {}
    for name in tracked.stdout.split():
        deployed = name.endswith((".yml", ".yaml", ".py", ".sh", ".env", "Makefile"))
        if not deployed or name.startswith("tests/"):
            continue
        path = ROOT / name
        if not path.is_file():
            continue
        for match in pattern.finditer(path.read_text(errors="replace")):
            used.setdefault(match.group(0), set()).add(name)
    assert len(used) > 50
    unknown = {}
    for service in SETTINGS_CLASSES:
        for variable in unknown_variables(_settings_class(service), dict.fromkeys(used, "")):
            unknown[variable] = sorted(used[variable])
    # Kubernetes' service links (NEBULA_SWITCH_SERVICE_HOST, ...) are switched off in every pod
    # (enableServiceLinks: false); the manifests name the variable only to say so.
    unknown.pop("NEBULA_SWITCH_SERVICE", None)
    assert not unknown, unknown
