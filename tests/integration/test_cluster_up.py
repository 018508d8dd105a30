"""`nebula cluster up` twice: two organisations, two run directories, two PKIs, one WAN port each.

The organisations exchange only CA certificates (``pki export-ca`` / ``trust add`` with the
fingerprint); each ``cluster up`` is its own process tree started on its own run directory, the
switch of ``a`` pointed at ``b``'s WAN port. The built-in numbers job trains between them. Neither
side's processes reference the other's run directory: checked on every process of both trees
through ``/proc/<pid>/environ`` (every path it was configured with) and ``/proc/<pid>/fd`` (every
file it holds open), after the job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nebula_common.cli.pki import app as pki_app
from nebula_common.ports import service_port
from nebula_common.sdk.client import submit_job
from nebula_common.sdk.deployment import endpoints_from_description, onboard
from nebula_common.sdk.summary import summarize
from tests.support.deployments import assert_gone, pids, references, wait_description
from tests.support.jobs import numbers_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]
START_DEADLINE_S = 180.0
E2E_ENV = "NEBULA_ORGS_E2E"


def _pki(*args: object) -> str:
    result = CliRunner().invoke(pki_app, [str(a) for a in args])
    assert result.exit_code == 0, result.output + result.stderr
    return result.stdout


def _nebula(*args: object) -> list[str]:
    return [sys.executable, "-m", "nebula_common.cli.app", *(str(a) for a in args)]


def _cluster_up(run_dir: Path, cluster: str, peer: str, wan_port: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        _nebula(
            "cluster", "up", "--cluster", cluster, "--peer", peer, "--run-dir", run_dir,
            "--wan-listen", f"127.0.0.1:{wan_port}",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip


@pytest.mark.skipif(
    not os.environ.get(E2E_ENV),
    reason=f"two full clusters and a job take 1.5-2 min on 2 busy cores: `make test-orgs` (sets {E2E_ENV}=1)",
)
def test_two_organisations_each_run_cluster_up_and_train_the_numbers_job(tmp_path: Path) -> None:
    runs = {c: tmp_path / f"org-{c}" / "run" for c in ("a", "b")}
    mail = tmp_path / "mail"
    mail.mkdir()
    for cluster in ("a", "b"):
        _pki("init", "--dir", runs[cluster] / "pki", "--cluster", cluster)
        _pki("export-ca", "--dir", runs[cluster] / "pki", "--cluster", cluster, "--out", mail)
    for cluster, peer in (("a", "b"), ("b", "a")):
        fingerprint = _pki("export-ca", "--dir", runs[peer] / "pki", "--cluster", peer, "--out", mail).strip()
        _pki(
            "trust", "add", "--dir", runs[cluster] / "pki", "--cluster", cluster, "--peer", peer,
            "--ca", mail / f"{peer}-ca.crt", "--fingerprint", fingerprint,
        )  # fmt: skip

    wan = {"a": service_port(), "b": service_port()}
    ups = {"b": _cluster_up(runs["b"], "b", "a", wan["b"])}
    try:
        ups["a"] = _cluster_up(runs["a"], "a", f"b=127.0.0.1:{wan['b']}", wan["a"])
        descriptions = {c: wait_description(ups[c], runs[c], START_DEADLINE_S) for c in ("b", "a")}
        for cluster, description in descriptions.items():
            assert set(description["clusters"]) == {cluster}
            assert len(pids(description)) == 6  # signer, auth, codec, data, switch, trainer

        sessions = {}
        for cluster, description in descriptions.items():
            endpoints, admin_file = endpoints_from_description(description)[cluster]
            sessions[cluster] = onboard(endpoints, admin_file.read_text().strip(), f"researcher-{cluster}")[0]
        job = numbers_job(steps=2, data__batch_size=16)
        summary = summarize(job, submit_job(job, sessions))
        assert summary.succeeded, summary

        for cluster, other in (("a", "b"), ("b", "a")):
            foreign = str(tmp_path / f"org-{other}")
            for pid in pids(descriptions[cluster]):
                leaked = [ref for ref in references(pid) if foreign in ref]
                assert not leaked, (
                    f"a process of {cluster} (pid {pid}) references {other}'s directory: {leaked}"
                )
        # `local status|down` name the command that holds the run directory.
        status = subprocess.run(
            _nebula("local", "status", "--run-dir", runs["a"]), capture_output=True, text=True, timeout=60
        )
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"is up (`nebula cluster up`, pid {ups['a'].pid})" in status.stdout, status.stdout
        assert "local up" not in status.stdout, status.stdout
        down = subprocess.run(
            _nebula("local", "down", "--run-dir", runs["b"]), capture_output=True, text=True, timeout=120
        )
        assert down.returncode == 0, down.stdout + down.stderr
        assert f"stopped `nebula cluster up` in {runs['b']} (pid {ups['b'].pid})" in down.stdout, down.stdout
        assert ups["b"].wait(timeout=60) == 0
        # b's CRL reached a over the link only: a's PKI holds no copy of it.
        assert not (runs["a"] / "pki" / "a" / "trust" / "b.crl.pem").exists()
        assert (runs["a"] / "a" / "switch" / "peer-crl.pem").read_bytes() == (
            runs["b"] / "pki" / "b" / "crl.pem"
        ).read_bytes()
    finally:
        for up in ups.values():
            if up.poll() is None:
                up.send_signal(signal.SIGINT)
        outputs = {c: up.communicate(timeout=90)[0] for c, up in ups.items()}
    for cluster, up in ups.items():
        assert up.returncode == 0, outputs[cluster]
    assert_gone(pids(descriptions["a"]) + pids(descriptions["b"]))


def test_cluster_up_without_trust_names_the_command_to_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _pki("init", "--dir", run_dir / "pki", "--cluster", "a")
    up = ("cluster", "up", "--cluster", "a", "--run-dir", run_dir)
    result = subprocess.run(
        _nebula(*up, "--peer", "b=127.0.0.1:7443"), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert "does not trust peer 'b' yet" in result.stderr and "nebula pki trust add" in result.stderr
    assert "Traceback" not in result.stderr
    bad = subprocess.run(_nebula(*up, "--peer", "b=nowhere"), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "HOST:PORT" in bad.stderr
