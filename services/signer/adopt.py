"""Hand services' old audit keys to the signer: ``python -m services.signer.adopt <log>=<dir> ...``.

A service deployed before the signer kept its seal key beside its log (``<dir>/audit-key.pem``); with a
signer it refuses to start while that key is there (whoever breaks into it could re-sign its past). A
deployment runs this once per start, before the signer and the services, with each service's data
directory and the signer's key directory mounted (compose's ``signer-init-<cluster>``, the Kubernetes
pods' ``adopt-audit-key`` init container; ``nebula local up`` calls ``adopt_key`` itself). The key is
moved, not copied or replaced, so the seals it made still verify. Both a service key and a signer key
for the same log stop it, naming both: only the operator can tell which one verifies the log.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nebula_common.audit.signing import AuditKeyError, adopt_key
from nebula_common.errors import NebulaError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.signer.adopt", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--keys", type=Path, required=True, help="the signer's data directory (NEBULA_SIGNER_DATA_DIR)"
    )
    parser.add_argument(
        "logs", nargs="+", metavar="LOG=DIR", help="a log's name and its service's data directory"
    )
    args = parser.parse_args(argv)
    try:
        for entry in args.logs:
            log, _, directory = entry.partition("=")
            if not log.isidentifier() or not directory.startswith("/"):
                raise NebulaError(f"{entry!r}: expected <log>=<absolute data directory of its service>")
            if not Path(directory).is_dir():
                raise NebulaError(f"{directory}: no such directory (the data directory of {log})")
            if adopt_key(Path(directory), args.keys / log, log=log):
                print(f"moved the audit key of {log} from {directory} to {args.keys / log}")
    except (AuditKeyError, NebulaError, OSError) as exc:
        print(f"adopt: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
