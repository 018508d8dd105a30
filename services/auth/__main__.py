"""``python -m services.auth`` / ``nebula-auth``.

Kept import-light so signals are handled from the very start (see ``run_service_main``).
"""

import sys

from nebula_common.service.host import run_service_main


def main() -> int:
    return run_service_main("auth", "services.auth.server:SERVICE")


if __name__ == "__main__":
    sys.exit(main())
