"""The WAN between two clusters as a submitter knows it, and the codec name that asks for advice.

Kept apart from ``codec_advice`` (which measures a micro-batch with torch) so that commands that only
list, watch or cancel jobs never import torch.
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"


@dataclass(frozen=True)
class LinkProfile:
    """The WAN between the clusters as the submitter knows it (emulator settings, or measured)."""

    bandwidth_mbit: float
    rtt_ms: float
    source: str = ""
    """Where the numbers come from (measured by a switch, or stated and why), for the job report."""

    def __post_init__(self) -> None:
        if not self.bandwidth_mbit > 0:
            raise ValueError(f"link bandwidth must be > 0 Mbit/s, got {self.bandwidth_mbit}")
        if self.rtt_ms < 0:
            raise ValueError(f"link RTT must be >= 0 ms, got {self.rtt_ms}")
