"""Arguments and errors shared by the ``nebula pki`` commands: cluster ids checked while Typer parses
them (a bad id is a usage error, exit 2, with the option named), operational failures exit 1."""

from __future__ import annotations

import typer

from nebula_common.cli.console import print_error
from nebula_common.pki.identity import validate_cluster_id


def fail(message: str) -> typer.Exit:
    """Report an operational error (bad state on disk, unreadable file) as exit code 1."""
    print_error(message)
    return typer.Exit(code=1)


def parse_clusters(value: str) -> list[str]:
    """Split ``a,b`` into validated, distinct cluster ids; usage errors exit with code 2."""
    ids = [part.strip() for part in value.split(",") if part.strip()]
    try:
        for cid in ids:
            validate_cluster_id(cid)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if len(set(ids)) != len(ids):
        raise typer.BadParameter(f"cluster ids must be distinct, got {value!r}")
    if len(ids) < 2:
        raise typer.BadParameter(f"need at least two clusters separated by commas, got {value!r}")
    return ids


def check_clusters(value: str | None) -> str | None:
    # Validate during parsing so Typer reports "Invalid value for '--clusters'" with usage help.
    if value is not None:
        parse_clusters(value)
    return value


def check_optional_cluster(value: str | None) -> str | None:
    return None if value is None else check_cluster(value)


def check_cluster(value: str) -> str:
    try:
        return validate_cluster_id(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
