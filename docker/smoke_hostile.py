"""A stage written to break out, run by an ordinary account on the compose deployment.

Run by docker/run-smoke.sh after smoke.py, with the same environment (each cluster's admin password and
CA certificate) and ``PYTHONPATH`` at the repository. The trainer's container cannot create namespaces,
so its stages run under Landlock (``services/trainer/landlock.py``). The hostile module of
``tests/support/hostile_probe.py``, submitted by an account of its own, tries from inside trainer-a's
container what it tries on ``nebula local up`` (tests/integration/test_security_hostile_stage.py):
read the trainer's TLS key and every other key, record and audit file of its data volume, another
account's checkpoints, the trainer's ``/proc`` entries; ptrace it; connect to auth, trainer, switch and
data; use its proxy socket for another job's edge and five foreign RPCs; open an edge on switch-a's
edge socket with a forged ticket; write into the volume,
``/etc``, ``/usr`` and ``/tmp``. Every attempt must fail, the trainer must run stages under Landlock,
and the proxy's refusals must be in trainer-a's audit log. Prints one JSON summary; exit 0 on success.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from compose_support import Compose, SmokeFailure, check, logger
from smoke import DEFAULT_PORTS, create_user, endpoints

from nebula_common.proto.nebula.v1 import trainer_pb2
from tests.support.hostile import hostile_job, run_job
from tests.support.jobs import numbers_job

TRAINER_DIR = "/var/lib/nebula/trainer"
EDGE_SOCKET = "/var/lib/nebula/edges/switch.sock"
"""switch-a's edge socket (docker-compose.yml): in trainer-a's container; a stage gets no ticket for it."""
PORTS = {"auth": "auth-a:7601", "trainer": "trainer-a:7500", "switch": "switch-a:7400", "data": "data-a:7800"}
log = logger("smoke-hostile")


def in_trainer(compose: Compose, script: str) -> str:
    """A Python snippet run in trainer-a's container as its service user."""
    return compose("exec", "-T", "trainer-a", "python", "-c", script, timeout=120)


def trainer_facts(compose: Compose, victim: str) -> dict[str, Any]:
    """What the attacker is told to go for: the trainer's pid and every file of its that holds a secret."""
    script = f"""
import json, os
pids = [int(p) for p in os.listdir("/proc") if p.isdigit()
        and b"nebula-trainer" in open(f"/proc/{{p}}/cmdline", "rb").read()]
files = []
for root in ("/etc/nebula", {TRAINER_DIR!r}):
    for top, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "accounts"]
        files += [os.path.join(top, n) for n in names]
print(json.dumps({{"pid": min(pids), "files": sorted(files)}}))
"""
    facts = json.loads(in_trainer(compose, script))
    facts["files"] += [f"{TRAINER_DIR}/stages", f"{TRAINER_DIR}/accounts/{victim}"]
    facts["files"] += ["/etc/nebula/internal-tls", "/proc/1/environ"]
    return facts


def run(
    compose: Compose,
    cas: dict[str, Path] | None = None,
    passwords: dict[str, str] | None = None,
    ports: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The probe against trainer-a; each cluster's CA, admin password and published ports default to
    run-smoke.sh's (``NEBULA_CA_CERT_<C>``, ``NEBULA_ADMIN_PASSWORD_<C>``, the default ports)."""
    cas = cas or {c: Path(os.environ[f"NEBULA_CA_CERT_{c.upper()}"]) for c in "ab"}
    passwords = passwords or {c: os.environ[f"NEBULA_ADMIN_PASSWORD_{c.upper()}"].strip() for c in "ab"}
    eps = {c: endpoints(c, (ports or DEFAULT_PORTS)[c], cas[c]) for c in "ab"}
    suffix = secrets.token_hex(3)
    victim = {c: create_user(eps[c], passwords[c], f"victim-{suffix}") for c in "ab"}
    mallory = {c: create_user(eps[c], passwords[c], f"mallory-{suffix}") for c in "ab"}

    announced = compose("logs", "trainer-a", timeout=120)
    check('"isolation": "landlock (ABI' in announced, "trainer-a does not announce stages under Landlock")
    victim_job = numbers_job(steps=2)
    ended = run_job(victim_job, victim, timeout=300)
    check(
        all(s.state == trainer_pb2.STAGE_STATE_SUCCEEDED for s in ended.values()),
        f"the victim's job did not succeed: {ended}",
    )
    facts = trainer_facts(compose, victim["a"].username)
    writes = [f"{TRAINER_DIR}/owned", "/etc/nebula/owned", "/usr/owned", "/tmp/owned"]
    with tempfile.TemporaryDirectory(prefix="smoke-hostile-") as tmp:
        job = hostile_job(
            Path(tmp),
            "probe",
            {
                "secrets": facts["files"],
                "trainer_pid": facts["pid"],
                "ports": PORTS,
                "victim_job": victim_job.job_id,
                "job": "probe",
                "writes": writes,
                "edge_socket": EDGE_SOCKET,
            },
        )
        final = run_job(job, mallory, timeout=300)["encoder"]
    check(
        final.state == trainer_pb2.STAGE_STATE_FAILED and "probe done" in final.message,
        f"the probe did not run to its end: {final}",
    )
    report = f"{TRAINER_DIR}/accounts/{mallory['a'].username}/probe-probe.json"
    found = json.loads(compose("exec", "-T", "trainer-a", "cat", report))
    check(found.pop("stage secret found in memory")["succeeded"], "the probe did not find its proxy secret")
    broke = {name: r["detail"] for name, r in found.items() if r["succeeded"]}
    check(not broke, f"the stage got through: {broke}")
    landed = in_trainer(compose, f"import os; print([p for p in {writes!r} if os.path.exists(p)])").strip()
    check(landed == "[]", f"a write outside the stage's directory landed: {landed}")
    audit = compose("exec", "-T", "trainer-a", "cat", f"{TRAINER_DIR}/audit.log")
    refused = [
        r for r in map(json.loads, filter(None, audit.splitlines())) if r.get("event") == "stage.refused"
    ]
    check(any(r.get("job_id") == job.job_id for r in refused), f"no stage.refused record: {refused[-3:]}")
    # The forged ticket reached switch-a's edge socket, which refused it and audited the refusal.
    forged = found["open an edge with a forged ticket"]["detail"]
    check("refused: UNAUTHENTICATED" in forged, f"the forged ticket was not refused by the switch: {forged}")
    switch_audit = compose("exec", "-T", "switch-a", "cat", "/var/lib/nebula/switch/audit.log")
    ticket_refusals = [
        r
        for r in map(json.loads, filter(None, switch_audit.splitlines()))
        if (r.get("event"), r.get("outcome")) == ("edge.open", "refused")
        and (r.get("details") or {}).get("layer") == "ticket"
    ]
    check(ticket_refusals, "switch-a's audit log has no edge.open refused at its edge socket's ticket")
    for sessions in (victim, mallory):
        for session in sessions.values():
            session.close()
    return {
        "attempts_refused": len(found),
        "secret_files_tried": len(facts["files"]),
        "audited_refusals": sum(r.get("job_id") == job.job_id for r in refused),
        "final_message": final.message[-200:],
        "forged_edge_ticket": forged,
        "job_id": job.job_id,
        "account": mallory["a"].username,
        "victim_job_id": victim_job.job_id,
    }


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    # The deployment docker/run-smoke.sh brought up (its project: COMPOSE may carry `-p NAME`).
    compose = Compose(None, ("docker-compose.yml",))
    started = time.monotonic()
    try:
        summary = run(compose)
    except (SmokeFailure, KeyError, AssertionError) as exc:
        print(f"smoke-hostile: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(json.dumps({"failed": str(exc)[-2000:]}))
        return 1
    summary["seconds"] = round(time.monotonic() - started, 1)
    log(f"done in {summary['seconds']} s")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
