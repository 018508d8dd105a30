"""Starting a service on ports of its own, pinned so a restart binds the same ones.

The launcher picks each port outside the ephemeral range (``ports.py``) and hands it to the service
in its environment; a port another program took in between is a bind failure, retried on new ports.
"""

from __future__ import annotations

import re
from pathlib import Path

from nebula_common.launcher.process import ServiceProcess, ServiceStartError, console_command
from nebula_common.launcher.service_box import ServiceBox
from nebula_common.ports import service_port

__all__ = ["BIND_ATTEMPTS", "BIND_FAILURE", "LOOPBACK", "START_TIMEOUT_S", "launch_pinned"]

LOOPBACK = "127.0.0.1"
BIND_ATTEMPTS = 3
# How long a starting process may take to listen. Its imports alone took over 30 s on 2 cores shared
# by four test runs (a deployment then failed to start); the supervisor allows a restart 90 s.
START_TIMEOUT_S = 90.0
BIND_FAILURE = re.compile(r"could not bind|address already in use", re.IGNORECASE)


def launch_pinned(
    name: str,
    module: str,
    prefix: str,
    settings: dict[str, str],
    pins: dict[str, str],
    log_dir: Path,
    *,
    fixed: dict[str, str] | None = None,
    box: ServiceBox | None = None,
) -> ServiceProcess:
    """Start a service on ports of its own, outside the ephemeral range (see ``ports.py``).

    The ports go into its environment, so a restart binds the same ones and its peers find it
    again. If another program took one of them between the check and the service's bind, the
    start is retried with new ports (a bind failure only; any other failure is raised). ``fixed``
    settings (an operator's WAN port, opened in a firewall) are never replaced.
    """
    fixed = fixed or {}
    for attempt in range(1, BIND_ATTEMPTS + 1):
        chosen = {setting: service_port() for setting in pins.values() if setting not in fixed}
        env = {prefix + key: value for key, value in settings.items()}
        for setting, port in chosen.items():
            env[prefix + setting] = str(port) if setting == "METRICS_PORT" else f"{LOOPBACK}:{port}"
        env.update({prefix + key: value for key, value in fixed.items()})
        process = ServiceProcess(
            name=name,
            command=console_command(module),
            env=env,
            log_dir=log_dir,
            holds_early_stop=True,
            box=box,
        )
        process.start()
        try:
            info = process.wait_ready(START_TIMEOUT_S)
        except ServiceStartError as exc:  # not yet in any state, so stop() would not know it
            process.stop()
            if attempt < BIND_ATTEMPTS and chosen and BIND_FAILURE.search(str(exc)):
                continue
            raise
        except BaseException:
            process.stop()
            raise
        for key, setting in pins.items():
            if setting in chosen and info.get(key) not in (None, -1, chosen[setting]):
                process.stop()
                raise ServiceStartError(
                    f"{name} reported {key} {info.get(key)}, but was told {chosen[setting]}"
                )
        return process
    raise AssertionError("unreachable: the last attempt returns or raises")
