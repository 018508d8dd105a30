"""Run one real switch (cluster b, accepting cluster a) plus its auth service for TLS scanners.

Used by ``bench/security/testssl.sh``: creates a throw-away dev PKI under ``--dir``, starts the
auth service and the switch exactly as their processes do (``start_service``),
prints one JSON line with the WAN port, and serves until SIGINT/SIGTERM. The scanner then talks
to the same dynamic-credential WAN listener production uses, not a test double.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import signal
from pathlib import Path

from nebula_common.pki import init_pki
from nebula_common.service.host import start_service
from services.auth.config import AuthSettings
from services.auth.server import SERVICE as AUTH_SERVICE
from services.switch.config import SwitchSettings
from services.switch.server import SERVICE as SWITCH_SERVICE


async def serve(work: Path, wan_listen: str) -> None:
    layout = init_pki(work / "pki", ["a", "b"])
    b = layout.cluster("b")
    password = work / "admin-password"
    password.write_text(secrets.token_urlsafe(16))
    auth = await start_service(
        AUTH_SERVICE,
        AuthSettings(cluster_id="b", data_dir=work / "auth", admin_password_file=password, metrics_port=-1),
    )
    try:
        switch = await start_service(
            SWITCH_SERVICE,
            SwitchSettings(
                cluster_id="b",
                peer_cluster_id="a",
                link_role="accept",
                wan_listen=wan_listen,
                tls_cert=b.switch_cert,
                tls_key=b.switch_key,
                trust_bundle=b.trust_bundle,
                auth_address=f"127.0.0.1:{auth.ports['grpc_port']}",
                data_dir=work / "switch",
                metrics_port=-1,
            ),
        )
        try:
            a = layout.cluster("a")
            print(
                json.dumps(
                    {
                        "wan_port": switch.handle.wan_port,
                        "server_name": "switch.b.nebula.internal",
                        "client_cert": str(a.switch_cert),
                        "client_key": str(a.switch_key),
                        "ca_file": str(a.trust_bundle),
                    }
                ),
                flush=True,
            )
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, stop.set)
            await stop.wait()
        finally:
            await switch.stop()
    finally:
        await auth.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="scratch directory (PKI, audit logs)")
    parser.add_argument("--wan-listen", default="127.0.0.1:0", help="WAN listen address (default: any port)")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    asyncio.run(serve(args.dir, args.wan_listen))


if __name__ == "__main__":
    main()
