"""Where one cluster's services listen: a plain value, shared by whoever starts or reaches them.

The launcher produces these (it started the processes and knows their ports), the SDK consumes
them (a session logs in and submits jobs there), and the CLI reads them from a deployment
description. Keeping the description here, with no behaviour and no imports of Nebula, lets the
launcher describe a deployment without depending on the SDK's job code, and the SDK use it without
depending on the launcher.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ClusterEndpoints:
    """Where one cluster's internal services listen (as seen from the operator's machine)."""

    cluster_id: str
    auth: str
    trainer: str
    switch: str
    metrics: dict[str, str] = field(default_factory=dict)
    codec: str = ""
    data: str = ""  # the data service (datasets, grants); "" in endpoints files written before it
