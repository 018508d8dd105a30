"""``python -m services.trainer`` / ``nebula-trainer``.

Kept import-light so signals are handled from the very start (see ``run_service_main``).
"""

import sys

from nebula_common.bulk_memory import keep_freed_memory_for_reuse
from nebula_common.service.host import run_service_main


def main() -> int:
    # A process-wide allocator choice, so made here and not in start_*() (tests run those in-process).
    keep_freed_memory_for_reuse()
    return run_service_main("trainer", "services.trainer.server:SERVICE")


if __name__ == "__main__":
    sys.exit(main())
