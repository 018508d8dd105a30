"""A hostile stage on a real ``nebula local up`` deployment: the job's code tries to own its cluster.

Every job's stage module runs in a confined process (``services/trainer/stage_process.py``,
``sandbox.py``). Here the encoder module of an ordinary account's job, written to break out, tries from
inside ``build()``: to read every private key, password and record of cluster a (named to it by path, as
an attacker who knows the layout would), another account's checkpoints, its trainer's environment and
memory; to ptrace it; to reach auth, the switch and the trainer over the network; to use its own proxy
socket, with the secret it digs out of its own memory, for another job's edge, another dataset, or the
trainer's and auth's RPCs; to write outside its account's directory. It writes what it found to its own
directory; every attempt must have failed, and the proxy's refusals must be audited. Misbehaving stages
(fork bombs and the like): ``test_stage_containment.py``.

It runs twice: on the shared deployment in its default mode (bubblewrap; where the trainer runs a weaker
mode that one skips, and with ``NEBULA_REQUIRE_BWRAP=1`` (CI) it fails instead), and on a deployment of
its own whose trainers run stages under Landlock (``NEBULA_TRAINER_STAGE_ISOLATION=landlock``, the mode
compose and Kubernetes get), which fails where the kernel has no Landlock. Run by
``make test-containment`` (in CI), not ``make test``: every stage process costs its interpreter's start (about
1.5 s), and ``make test`` is kept under ten minutes.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nebula_common.launcher import LocalDeployment
from nebula_common.proto.nebula.v1 import trainer_pb2
from tests.support.accounts import make_user
from tests.support.hostile import hostile_job, require_bwrap, run_job
from tests.support.jobs import numbers_job

pytestmark = [pytest.mark.integration, pytest.mark.containment, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def landlocked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    """A deployment whose trainers confine stages with Landlock (start-up fails where they cannot)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NEBULA_TRAINER_STAGE_ISOLATION", "landlock")  # the services inherit it
        running = LocalDeployment(
            run_dir=tmp_path_factory.mktemp("landlocked"), bandwidth_mbit=100.0, delay_ms=5.0
        )
        running.start()
    try:
        yield running
    finally:
        running.stop()


def test_stage_code_reaches_no_key_token_process_or_port(deployment: LocalDeployment, tmp_path: Path) -> None:
    require_bwrap(deployment)
    break_out(deployment, tmp_path)


def test_under_landlock_too(landlocked: LocalDeployment, tmp_path: Path) -> None:
    log = (landlocked.log_dir / "trainer-a.log").read_text(errors="replace")
    assert '"isolation": "landlock (ABI' in log, "trainer-a does not run stages under Landlock"
    break_out(landlocked, tmp_path)


def break_out(deployment: LocalDeployment, tmp_path: Path) -> None:
    suffix = secrets.token_hex(3)
    tenants = {
        "a": make_user(deployment, "a", f"mallory-{suffix}"),
        "b": make_user(deployment, "b", f"mallory-{suffix}"),
    }
    run = deployment.run_dir
    victim = {"a": make_user(deployment, "a", f"victim-{secrets.token_hex(3)}")}
    victim["b"] = make_user(deployment, "b", victim["a"].username)
    victim_job = numbers_job(steps=2)
    run_job(victim_job, victim)  # leaves checkpoints under the victim's account
    trainer_dir = run / "a" / "trainer"
    secrets_to_read = [
        *(str(p) for p in sorted((run / "pki").rglob("*.key"))),
        str(run / "a" / "auth" / "signing-key.pem"),
        str(run / "a" / "admin-password"),
        str(trainer_dir / "stages"),
        str(trainer_dir / "accounts" / victim["a"].username),
        str(run / "credentials"),
        "/etc/shadow",
    ]
    endpoints = deployment.endpoints("a")
    ports = {
        "auth": endpoints.auth,
        "trainer": endpoints.trainer,
        "switch": endpoints.switch,
        "data": endpoints.data,
    }
    trainer_pid = deployment.process("trainer-a").popen.pid  # type: ignore[union-attr]
    job = hostile_job(
        tmp_path,
        "probe",
        {
            "secrets": secrets_to_read,
            "trainer_pid": trainer_pid,
            "ports": ports,
            "victim_job": victim_job.job_id,
            "job": "probe",
            "writes": [
                str(run / "owned"),
                str(trainer_dir / "owned"),
                "/usr/owned",
                str(Path.cwd() / "owned"),
            ],
        },
    )
    final = run_job(job, tenants)["encoder"]
    assert final.state == trainer_pb2.STAGE_STATE_FAILED and "probe done" in final.message, final
    report_file = trainer_dir / "accounts" / tenants["a"].username / "probe-probe.json"
    found = json.loads(report_file.read_text())
    assert found.pop("stage secret found in memory")["succeeded"]  # the attacker did its homework
    # A write may land in bubblewrap's own throw-away tmpfs; what matters is that the host has none.
    writes = [w for w in found if w.startswith("write ")]
    assert len(writes) == 4 and not [w for w in writes if Path(w[len("write ") :]).exists()], writes
    broke = {name: r["detail"] for name, r in found.items() if r["succeeded"] and name not in writes}
    assert not broke, f"the stage got through: {broke}"
    assert len(found) >= len(secrets_to_read) + 15, sorted(found)
    assert "NEBULA" not in found["environment"]["detail"]
    refused = [e for e in _trainer_audit(deployment) if e.get("event") == "stage.refused"]
    assert any(e.get("job_id") == job.job_id for e in refused), refused[-3:]


def _trainer_audit(deployment: LocalDeployment) -> list[dict[str, Any]]:
    path = deployment.run_dir / "a" / "trainer" / "audit.log"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
