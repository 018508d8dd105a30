"""A job's log records, gathered from wherever the deployment's services log.

Every service logs JSON records that name the job they concern; ``nebula job logs`` shows one
job's, oldest first, each with the process it came from: from a local run's log directory, or
through the log command an endpoints file names (``podman-compose logs``, ``kubectl logs``).
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from nebula_common.errors import NebulaError

__all__ = ["LOG_COMMAND_TIMEOUT_S", "command_log_records", "job_log_records"]

LOG_COMMAND_TIMEOUT_S = 60.0


def _command_output(argv: list[str], service: str) -> str:
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=LOG_COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NebulaError(f"cannot read the logs of {service}: `{' '.join(argv)}`: {exc}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise NebulaError(f"`{' '.join(argv)}` exited {done.returncode}: {tail[0]}")
    return done.stdout + done.stderr


def command_log_records(logs: dict[str, Any], job_id: str) -> list[dict[str, Any]]:
    """The JSON log records naming ``job_id`` that the endpoints file's log command prints per service.

    ``logs`` is ``{"command": [...], "services": [...]}``: ``command + [service]`` prints that
    service's log (``podman-compose logs trainer-a``, ``kubectl -n nebula logs deploy/trainer-a``);
    the services are read in parallel (each command is a process start). Lines that are not a JSON
    record (an engine's prefix is skipped up to the first ``{``) are ignored; each record gets
    ``source``, the service it was read from.
    """
    services = list(logs["services"])
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(services)))) as pool:
        outputs = list(pool.map(lambda svc: _command_output([*logs["command"], svc], svc), services))
    records = []
    for service, output in zip(services, outputs, strict=True):
        for line in output.splitlines():
            if job_id not in line or "{" not in line:
                continue
            try:
                record = json.loads(line[line.index("{") :])
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("job_id") == job_id:
                record["source"] = service
                records.append(record)
    return sorted(records, key=lambda r: str(r.get("ts", "")))


def job_log_records(description: dict[str, Any], job_id: str) -> list[dict[str, Any]]:
    """Every JSON log record naming ``job_id`` in the deployment's log directory, oldest first; each
    gets ``source``, the process whose log file it is in (``trainer-a``: service and cluster)."""
    log_dir = description.get("log_dir")
    if not isinstance(log_dir, str) or not Path(log_dir).is_dir():
        raise NebulaError(
            "this deployment description names no log directory (only `nebula local up` writes one); "
            "read the services' logs where they run (e.g. `docker compose logs trainer-a`)"
        )
    records = []
    for path in sorted(Path(log_dir).glob("*.log")):
        with path.open(errors="replace") as lines:
            for line in lines:
                if job_id not in line:
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and record.get("job_id") == job_id:
                    record["source"] = path.stem  # the process: service and cluster (trainer-a)
                    records.append(record)
    return sorted(records, key=lambda r: str(r.get("ts", "")))
