"""`nebula cluster up` with several peers (a chain's middle): each --peer is checked before starting."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

from nebula_common.cli.app import app as nebula
from nebula_common.cli.pki import app as pki_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _nebula(*args: object) -> Result:
    """The CLI in this process (no process is started: every case fails its checks first)."""
    return CliRunner().invoke(nebula, [str(a) for a in args])


def test_every_peer_must_be_trusted_and_named_once(tmp_path: Path) -> None:
    pki = tmp_path / "orgs"
    for cluster in ("a", "b", "c"):
        result = CliRunner().invoke(pki_app, ["init", "--dir", str(pki / cluster), "--cluster", cluster])
        assert result.exit_code == 0, result.output
    # b trusts a only: a second peer c is refused naming the command that fixes it.
    fingerprint = CliRunner().invoke(
        pki_app, ["export-ca", "--dir", str(pki / "a"), "--cluster", "a", "--out", str(tmp_path)]
    )
    assert fingerprint.exit_code == 0, fingerprint.output
    trusted = CliRunner().invoke(
        pki_app,
        [
            *("trust", "add", "--dir", str(pki / "b"), "--cluster", "b", "--peer", "a"),
            *("--ca", str(tmp_path / "a-ca.crt"), "--fingerprint", fingerprint.stdout.strip()),
        ],
    )
    assert trusted.exit_code == 0, trusted.output
    up = ("cluster", "up", "--cluster", "b", "--run-dir", tmp_path / "run", "--pki-dir", pki / "b")
    result = _nebula(*up, "--peer", "a", "--peer", "c=127.0.0.1:7443")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert "does not trust peer 'c' yet" in result.stderr and "Traceback" not in result.stderr
    twice = _nebula(*up, "--peer", "a", "--peer", "a")
    assert twice.exit_code == 2 and "each peer once" in twice.stderr, twice.stderr
    itself = _nebula(*up, "--peer", "a", "--peer", "b")
    assert itself.exit_code == 1 and "another cluster than 'b'" in itself.stderr, itself.stderr
