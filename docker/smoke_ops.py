"""Operating the compose deployment from the host, as an operator would, after docker/smoke.py.

    PYTHONPATH=$PWD .venv/bin/python docker/smoke_ops.py [--steps 200] [--out DIR]

(run by docker/run-smoke.sh once every service is healthy; COMPOSE names the engine, default
podman-compose). Every step goes through the one endpoints file and the `nebula` CLI:

1. ``nebula compose endpoints --out DIR`` writes the endpoints file (published ports, each cluster's
   CA certificate and admin password, copied out of the auth containers); ``nebula account create|
   list|grants|disable --deployment DIR`` manage an account through it;
2. a job is submitted through ``Deployment.open(DIR)``; once it has checkpointed, the compose trainer
   of cluster a is killed (SIGKILL, as a crash) and started again on its named volume. The job must
   resume (its stage in a at a higher epoch) and end SUCCEEDED, or end with a reason; ``nebula job
   watch`` follows it to its end across the restart;
3. the restarted trainer resumed holding the checkpoints it wrote before the kill (named volume; its
   "resume exchanged" log record), and its sealed audit log verifies (``nebula audit verify``);
4. ``nebula job status|report|logs|list`` work against the compose deployment (the report's PNGs are
   checked as PNGs; logs come from the containers through the endpoints file's log command);
5. a second, long job rides a restart of trainer-a asked for politely (SIGTERM) and resumes
   by itself at a higher epoch (the trainer drains its stages, it cancels nothing); then it is
   cancelled with ``nebula job cancel``: both stages end CANCELLED.

Prints one JSON summary; exits 1 naming the first thing that was not as expected.
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from compose_support import ROOT, Compose, SmokeFailure, check, logger
from typer.testing import CliRunner

from nebula_common.cli.app import app
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.api import Deployment

# The deployment docker/run-smoke.sh brought up (its project: COMPOSE may carry `-p NAME`).
compose = Compose(None, ("docker-compose.yml",))
TRAINER_DIR = "/var/lib/nebula/trainer"
CHECKPOINT_INTERVAL = 5
KILL_AFTER_STEP = 12  # past two checkpoints of both stages
# The job must outlive the kill: from step 12 to the SIGKILL take the checkpoint listing and
# `compose kill` (1-5 s through podman on a busy host), and a step takes ~0.15 s. With 60 steps the
# job once finished before trainer-a was killed (CI beside a busy core); 200 leave ~28 s.
DEFAULT_STEPS = 200
RESTART_TIMEOUT_S = 180.0
log = logger("smoke-ops")


def nebula(*args: str) -> Any:
    """A `nebula` command in this process; its stdout parsed as JSON (every command here has --json)."""
    result = CliRunner().invoke(app, list(args))
    check(
        result.exit_code == 0, f"`nebula {' '.join(args)}` exited {result.exit_code}: {result.output[-800:]}"
    )
    return json.loads(result.stdout)


def checkpoints(owner: str, job_id: str, stage: str) -> list[str]:
    listing = compose(
        "exec", "-T", "trainer-a", "ls", f"{TRAINER_DIR}/accounts/{owner}/jobs/{job_id}/{stage}"
    )
    return sorted((n for n in listing.split() if n.startswith("step-")), key=lambda n: int(n[5:]))


def wait_for_step(job: Any, step: int) -> None:
    for status in job.metrics():
        if status.steps_done >= step:
            return
    raise SmokeFailure(f"job {job.id} ended before step {step}: {job.status().to_json()}")


def restart_trainer_a(deployment: Deployment, job_id: str) -> float:
    """SIGKILL trainer-a, start it again, and wait until it answers (lists the job) again."""
    started = time.monotonic()
    compose("kill", "-s", "KILL", "trainer-a")
    compose("start", "trainer-a")  # a restart policy may have started it already: then a no-op
    deadline = started + RESTART_TIMEOUT_S
    while True:
        try:
            deployment.close()  # fresh channels to the restarted trainer
            if deployment.job(job_id).status().stages:
                return time.monotonic() - started
        except Exception as exc:  # not up yet: any error until the deadline
            if time.monotonic() > deadline:
                raise SmokeFailure(
                    f"trainer-a not answering {RESTART_TIMEOUT_S:.0f} s after its kill: {exc}"
                ) from None
        time.sleep(1.0)


def rolling_restart_keeps(job: Any) -> dict[str, Any]:
    """SIGTERM to trainer-a (what an upgrade or `compose stop` sends) stops the trainer, not the job: its
    stage is drained, the trainer exits 0, and once started again it resumes the stage at a higher
    epoch; nothing is CANCELLED. (podman-compose 1.6's `restart` refuses a service whose one-shot
    dependency has exited, and says so with exit code 0: hence the signal, a wait and a start.)"""
    statuses = job.metrics()
    next(statuses)  # the job's record is read and its watch open before the trainer goes: it rides through
    started = time.monotonic()
    names = subprocess.run(
        ["podman", "ps", "--filter", "label=io.podman.compose.service=trainer-a", "--format", "{{.Names}}"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.split()  # fmt: skip
    check(len(names) == 1, f"trainer-a's container: {names}")
    compose("kill", "-s", "TERM", "trainer-a")
    # It drains and exits 0 by itself; podman's restart policy leaves a signalled container stopped, so
    # the operator's start (as after an upgrade) brings it back.
    ended = subprocess.run(["podman", "wait", names[0]], capture_output=True, text=True, timeout=60)
    check(ended.stdout.strip() == "0", f"trainer-a did not exit 0 on SIGTERM: {ended.stdout} {ended.stderr}")
    compose("start", "trainer-a")
    for status in statuses:
        state = status.state
        check(
            time.monotonic() - started < RESTART_TIMEOUT_S,
            f"trainer-a's stage not resumed {RESTART_TIMEOUT_S:.0f} s after its SIGTERM (last: {status})",
        )
        check(
            state not in (trainer_pb2.STAGE_STATE_CANCELLED, trainer_pb2.STAGE_STATE_FAILED),
            f"the job ended across trainer-a's restart: {status}",
        )
        stepping = state == trainer_pb2.STAGE_STATE_RUNNING and status.steps_done > status.resumed_from_step
        if status.stage == "encoder" and status.epoch >= 1 and stepping:
            return {"resumed_epoch": status.epoch, "seconds": round(time.monotonic() - started, 1)}
    raise SmokeFailure(f"job {job.id} ended before its stage in a resumed after the restart")


def is_png(path: Path) -> bool:
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 8_000


def manage_an_account(dep: tuple[str, str]) -> str:
    """`nebula account` through the same endpoints file: create (stored 0600 beside it), list, grants
    (the data service's published port), disable."""
    user = f"ops-{secrets.token_hex(3)}"
    created = nebula("account", "create", user, *dep, "--json")
    stored = Path(created["credentials_file"] or "")
    check(
        set(created["accounts"]) == {"a", "b"} and stored.is_file() and stored.stat().st_mode & 0o077 == 0,
        f"account create: {created}",
    )
    listed = nebula("account", "list", *dep, "--cluster", "a", "--json")
    check(user in {row["username"] for row in listed}, f"account list: {listed}")
    grants = nebula("account", "grants", user, *dep, "--json")
    empty = {"granted_to_it": [], "its_datasets": {}}
    check([row["datasets"] for row in grants] == [empty, empty], f"account grants: {grants}")
    disabled = nebula("account", "disable", user, *dep, "--json")
    check(all(row["disabled"] for row in disabled), f"account disable: {disabled}")
    return user


def run(steps: int, out: Path) -> dict[str, Any]:
    endpoints = out / "compose"
    result = CliRunner().invoke(
        app, ["compose", "endpoints", "--out", str(endpoints), "--file", str(ROOT / "docker-compose.yml")]
    )
    check(result.exit_code == 0, f"nebula compose endpoints: {result.output}")
    dep = ("--deployment", str(endpoints))
    summary: dict[str, Any] = {"endpoints": str(endpoints / "endpoints.json")}
    summary["account"] = manage_an_account(dep)
    with Deployment.open(endpoints) as deployment:
        job = deployment.submit(
            builtin_spec("numbers"), {"steps": steps, "checkpoint.interval": CHECKPOINT_INTERVAL}
        )
        owner = deployment.credentials["a"]["username"]
        log(f"job {job.id} submitted as {owner}; killing trainer-a after step {KILL_AFTER_STEP}")
        wait_for_step(job, KILL_AFTER_STEP)
        before = checkpoints(owner, job.id, "encoder")
        check(len(before) >= 2, f"encoder checkpoints before the kill: {before}")
        summary["restart_seconds"] = round(restart_trainer_a(deployment, job.id), 1)
        log(f"trainer-a back after {summary['restart_seconds']} s; watching the job to its end")

    lines = CliRunner().invoke(app, ["job", "watch", job.id, *dep, "--json"])
    check(lines.exit_code == 0, f"nebula job watch: {lines.output[-800:]}")
    final = json.loads(lines.stdout.strip().splitlines()[-1])["final"]
    encoder = next(s for s in final["stages"] if s["stage"] == "encoder")
    summary["job"] = {"id": job.id, "state": final["state"], "encoder_epoch": encoder["epoch"]}
    summary["job"]["messages"] = {s["stage"]: s["message"] for s in final["stages"]}
    if final["state"] != "SUCCEEDED":  # the issue allows a clear reason; the summary shows it
        check(all(s["message"] for s in final["stages"] if s["state"] != "SUCCEEDED"), f"no reason: {final}")
    else:
        check(final["steps_done"] == steps, f"steps {final['steps_done']}/{steps}")
    check(
        encoder["epoch"] >= 1,
        "the encoder stage was not restarted at a higher epoch (if it ended before the kill, "
        f"the job was too short for this host: raise --steps): {encoder}",
    )

    after = checkpoints(owner, job.id, "encoder")
    if final["state"] == "SUCCEEDED":
        check(after[-1] == f"step-{steps}", f"no final checkpoint: {after}")
    summary["checkpoints"] = {"before_kill": before, "at_end": after}
    verified = compose("exec", "-T", "trainer-a", "nebula", "audit", "verify", f"{TRAINER_DIR}/audit.log")
    check(verified.startswith("OK"), f"audit verify: {verified}")
    summary["audit_verify"] = " ".join(verified.split())

    status = nebula("job", "status", job.id, *dep, "--json")
    check(status["state"] == final["state"], f"status {status['state']} != watch {final['state']}")
    page = out / f"{job.id}-report.html"
    written = nebula("job", "report", job.id, *dep, "--out", str(page), "--json")
    check(page.is_file() and job.id in page.read_text(), f"report page {page}")
    check(all(is_png(Path(p)) for p in written["png"]), f"report PNGs {written['png']}")
    summary["report"] = written
    records = nebula("job", "logs", job.id, *dep, "--json")
    services = sorted({r.get("source", "") for r in records})
    check(
        any(s.startswith("trainer-a") for s in services), f"no trainer-a log records of the job: {services}"
    )
    summary["log_records"] = {"count": len(records), "services": services}
    # The named volume kept the checkpoints: the restarted trainer-a resumed (epoch >= 1) holding
    # checkpoints at least as new as the newest listed before the kill (it keeps the last few).
    resumed = [
        r for r in records if r.get("source") == "trainer-a" and r.get("message") == "resume exchanged"
    ]
    held = [step for r in resumed if int(r.get("epoch", 0)) >= 1 for step in r.get("held") or []]
    newest_before = int(before[-1].removeprefix("step-"))
    check(held and max(held) >= newest_before, f"trainer-a resumed holding {held}, before the kill {before}")
    summary["checkpoints"]["held_after_restart"] = sorted(set(held))

    with Deployment.open(endpoints) as deployment:
        long_job = deployment.submit(builtin_spec("numbers"), {"steps": 100_000, "checkpoint.interval": 0})
        wait_for_step(long_job, 2)
        summary["rolling_restart"] = rolling_restart_keeps(long_job)
    cancelled = nebula("job", "cancel", long_job.id, *dep, "--json")
    check(
        cancelled["state"] == "CANCELLED" and all(s["state"] == "CANCELLED" for s in cancelled["stages"]),
        f"cancel: {cancelled}",
    )
    listed = [j["job_id"] for j in nebula("job", "list", *dep, "--json")]
    check({job.id, long_job.id} <= set(listed), f"job list {listed}")
    summary["cancelled"] = long_job.id
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description="Operate the compose deployment from the host.")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--out", type=Path, default=None, help="Where the endpoints file and report go.")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="nebula-smoke-ops-"))
    started = time.monotonic()
    try:
        summary = run(args.steps, out)
    except SmokeFailure as exc:
        print(f"smoke-ops: FAILED: {exc}", file=sys.stderr)
        return 1
    summary["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
