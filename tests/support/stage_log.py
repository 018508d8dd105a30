"""Where a program stage says it runs: the fields of its "program stage running" log record.

A stage on several ranks logs, once it runs, how many ranks it has, each rank's host and the parameter
bytes each rank holds. Tests capture it with ``caplog.set_level(logging.INFO, logger=STAGE_LOGGER)``.
"""

from __future__ import annotations

import logging
from typing import Any

STAGE_LOGGER = "services.trainer.runtime.stage"


def stage_running(records: list[logging.LogRecord], stage: str) -> list[dict[str, Any]]:
    """The fields of every "program stage running" record that ``stage`` logged, in order."""
    return [
        fields
        for record in records
        if record.getMessage() == "program stage running"
        and (fields := getattr(record, "fields", {})).get("stage") == stage
    ]
