"""``python -m services.signer`` / ``nebula-signer``.

Kept import-light so signals are handled from the very start (see ``run_service_main``).
"""

import sys

from nebula_common.service.host import run_service_main


def main() -> int:
    return run_service_main("signer", "services.signer.server:SERVICE")


if __name__ == "__main__":
    sys.exit(main())
