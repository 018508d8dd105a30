"""Prometheus counters of the data service: refusals are the first sign of one tenant probing another."""

from __future__ import annotations

from prometheus_client import Counter

REQUESTS = Counter("nebula_data_requests", "Data service calls by method and outcome.", ["method", "outcome"])
RECORDS_READ = Counter("nebula_data_records_read", "Records served by ReadBatch (owners and grantees).")

for _method in ("read", "grant", "revoke", "download"):
    for _outcome in ("ok", "refused"):
        REQUESTS.labels(_method, _outcome)
