"""Prometheus counters of the auth service: login failures are the first sign of guessing attacks."""

from __future__ import annotations

from prometheus_client import Counter

LOGINS = Counter("nebula_auth_logins", "Login attempts by outcome.", ["outcome"])
ACCOUNTS_CREATED = Counter("nebula_auth_accounts_created", "Accounts created.")
TOKENS_ISSUED = Counter("nebula_auth_tokens_issued", "Tokens issued.")

# Export both outcomes from the start so rate() and alerts work before the first failure.
LOGINS.labels(outcome="success")
LOGINS.labels(outcome="failure")
