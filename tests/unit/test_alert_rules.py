"""The alert rules are valid Prometheus rules, and each one fires, after its hold time, on the series
that should fire it and on no other (``promtool test rules``, Prometheus' own rule unit tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.prometheus import REQUIRE_ENV

MONITORING = Path(__file__).resolve().parents[2] / "docker" / "monitoring"
RULES = MONITORING / "alerts.yml"
RULE_TESTS = MONITORING / "alerts-test.yml"


def _promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{REQUIRE_ENV} is set but promtool is not on PATH (apt-get install prometheus)")
        pytest.skip("promtool not installed (Debian: apt-get install prometheus; CI installs it)")
    return binary


def test_the_rules_pass_promtool_check() -> None:
    done = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_fires_when_it_should_and_only_then() -> None:
    done = subprocess.run(
        [_promtool(), "test", "rules", RULE_TESTS.name],
        cwd=MONITORING,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_a_rule_test() -> None:
    rules = yaml.safe_load(RULES.read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule}
    tests = yaml.safe_load(RULE_TESTS.read_text())
    tested = {case["alertname"] for test in tests["tests"] for case in test.get("alert_rule_test", [])}
    assert len(alerts) >= 9
    assert alerts == tested, f"alerts without a rule test: {sorted(alerts - tested)}"
