"""Under `nebula local up` each service reads only its own secrets: every key has one owner.

For every process of the shared two-cluster deployment, every secret file of the run directory (private
keys, audit and signing keys, the account database, the admin passwords, the WAN control token) is
looked up through that process's own root (``/proc/<pid>/root``: its mount namespace, what it can
open) and counted as readable only when the bytes there are the real file's. Auth, codec, data, the
switch and the audit signer must read exactly their own (the signer: every service's audit seal key,
which no service reads any more); their ``/proc`` must show no process but their own, so no other
process's memory or environment is within reach either. The trainer is boxed too (``trainer_box.py``):
it sees only its own data directory and identity and, run by root, is a user of its own without any
capability, so even what a stage might make it do happens without root's rights.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest

from nebula_common.launcher import LocalDeployment
from nebula_common.launcher.service_box import filter_missing, unavailable
from nebula_common.launcher.userns import TRAINER_UID
from nebula_common.pki.lifecycle import renew_switch_certificate

pytestmark = pytest.mark.integration

BOXED = ("auth", "codec", "data", "switch", "trainer")


def _secrets(run_dir: Path) -> list[Path]:
    """Every file of the run directory whose bytes must stay with their owner."""
    found = []
    for path in sorted(run_dir.rglob("*")):
        name = path.name
        secret = (
            path.suffix in (".key", ".db")
            or (name.endswith("key.pem") and not name.endswith(".pub.pem"))
            or name in ("admin-password", "wan-control-token")
        )
        if secret and path.is_file():
            found.append(path)
    return found


def _readable(pid: int, secrets: list[Path]) -> set[Path]:
    """The secrets whose real bytes ``pid`` would read at their path (its mount namespace's view)."""
    root = Path(f"/proc/{pid}/root")
    seen = set()
    for path in secrets:
        try:
            if (root / path.relative_to("/")).read_bytes() == path.read_bytes():
                seen.add(path)
        except OSError:
            continue
    return seen


def _own(run_dir: Path, cluster: str, service: str) -> set[Path]:
    """Where ``service`` of ``cluster`` keeps its own secrets."""
    pki = run_dir / "pki" / cluster
    own = {*(pki / "services" / service).glob("*.key")}
    own |= {p for p in _secrets(run_dir / cluster / service)}
    if service == "auth":
        own.add(run_dir / cluster / "admin-password")
    if service == "switch":
        own.add(pki / "switch.key")
    return own


def test_each_boxed_service_reads_only_its_own_secrets(deployment: LocalDeployment) -> None:
    if unavailable():
        pytest.skip(f"services are not boxed here: {unavailable()}")
    run_dir = deployment.run_dir
    # Replaced files must stay hidden too: a file hidden by a mount over its path would show again once
    # renamed over (a renewal writes a new file and renames it), so rotate the WAN keys first.
    for cluster in deployment.clusters:
        renew_switch_certificate(deployment.pki_dir, cluster, validity=timedelta(hours=24))
    secrets = _secrets(run_dir)
    assert len(secrets) >= 30, secrets  # keys of 2 clusters x 6 identities, CA and audit keys, ...
    for cluster in deployment.clusters:
        for service in ("signer", *BOXED):
            process = deployment.process(f"{service}-{cluster}")
            assert process.box is not None and process.pid is not None, process.name
            readable = _readable(process.pid, secrets)
            own = _own(run_dir, cluster, service)
            assert own, process.name
            assert readable == own, (
                f"{process.name} reads {sorted(map(str, readable - own))} of others and misses "
                f"{sorted(map(str, own - readable))} of its own"
            )
            pids = [entry for entry in os.listdir(f"/proc/{process.pid}/root/proc") if entry.isdigit()]
            status = Path(f"/proc/{process.pid}/status").read_text()
            if service == "trainer":  # its stages' boxes may run beside it, never another service
                assert "1" in pids and len(pids) == 1 + _descendants(process.pid), (process.name, pids)
                _assert_not_root(status, process.name)
                continue
            assert pids == ["1"], f"{process.name} sees processes {pids} besides itself"
            if not filter_missing():  # bubblewrap loaded the services' seccomp filter (mode 2) before it
                assert "\nSeccomp:\t2\n" in status, f"{process.name} runs without its seccomp filter"
    described = deployment.describe()["service_isolation"]
    assert "the switch and the trainer each see only their own" in described
    assert ("seccomp allows" if not filter_missing() else "no seccomp filter") in described


def _descendants(pid: int) -> int:
    """How many processes run below ``pid`` (a boxed trainer's stages and their boxes)."""
    from services.trainer.cgroup import descendants

    return len(descendants(pid))


def _assert_not_root(status: str, name: str) -> None:
    """Run by root, the trainer is ``TRAINER_UID`` with no capability left (``box_entry.py``)."""
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if os.geteuid() == 0:
        assert fields["Uid"].split() == [str(TRAINER_UID)] * 4, (name, fields["Uid"])
        assert fields["Gid"].split() == [str(TRAINER_UID)] * 4, (name, fields["Gid"])
    for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[key], 16) == 0, (name, key, fields[key])
    assert fields["NoNewPrivs"].strip() == "1", name


def test_each_service_reads_the_current_crl_in_its_own_directory(deployment: LocalDeployment) -> None:
    """The launcher copies the cluster's CRL to each service (its box shows no other part of the PKI)."""
    for cluster in deployment.clusters:
        crl = (deployment.pki_dir / cluster / "crl.pem").read_bytes()
        for service in (*BOXED, "trainer"):
            process = deployment.process(f"{service}-{cluster}")
            copy = Path(process.env["NEBULA_" + service.upper() + "_INTERNAL_CRL"])
            assert copy.parent.name == service and copy.read_bytes() == crl, copy
            if process.box is not None:
                assert (Path(f"/proc/{process.pid}/root") / copy.relative_to("/")).read_bytes() == crl


def test_the_lookup_finds_every_secret_from_a_process_without_a_box(deployment: LocalDeployment) -> None:
    """A check that can fail: the same lookup finds every secret from this test's own process."""
    secrets = _secrets(deployment.run_dir)
    assert _readable(os.getpid(), secrets) == set(secrets)
