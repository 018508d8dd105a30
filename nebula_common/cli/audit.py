"""``nebula audit`` commands: verify a service's audit log, and read it."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated

import grpc
import typer
from rich.markup import escape

from nebula_common.audit import (
    PUBLIC_KEY_NAME,
    AuditFilter,
    AuditKeyError,
    SealVerifier,
    query_log,
    verify_log,
)
from nebula_common.audit.query import MAX_LIMIT
from nebula_common.audit.verify import verify_segments
from nebula_common.audit.witness import WitnessResult, check_witnessed
from nebula_common.cli.console import new_console, print_error
from nebula_common.proto.nebula.v1 import audit_pb2, audit_pb2_grpc
from nebula_common.rpc import bearer_metadata
from nebula_common.rpc.internal_tls import InternalTlsError, internal_channel

app = typer.Typer(help="Tamper-evident audit logs of the services.", no_args_is_help=True)


def _fail(message: str, code: int = 1) -> typer.Exit:
    print_error(message)
    return typer.Exit(code=code)


@app.command()
def verify(
    log: Annotated[Path, typer.Argument(help="The audit.log file to check.")],
    key: Annotated[
        Path | None,
        typer.Option(
            help="Pinned public seal key (PEM). Default: audit-key.pub.pem next to the log, which only "
            "proves consistency: someone able to rewrite the log could also replace that file."
        ),
    ] = None,
    seal: Annotated[Path | None, typer.Option(help="Seal file. Default: <log>.seal.")] = None,
    expect_key_id: Annotated[
        str | None, typer.Option(help="Fail unless the key's id (16 hex chars) is this one.")
    ] = None,
    max_seal_age_s: Annotated[
        float | None, typer.Option(min=0, help="Fail when the newest seal is older than this.")
    ] = None,
    witness: Annotated[
        Path | None,
        typer.Option(
            help="The audit log of the peer switch that witnessed this one (its audit.witness records): "
            "also prove the log was not rewritten or cut short up to the newest head it witnessed, "
            "whoever holds the signing key. Verify that log with its own pinned key too."
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the verdict as JSON (the exit code is the same).")
    ] = False,
) -> None:
    """Detect any edit, deletion, reordering, insertion or truncation; name the first bad record.

    Exit code 0: intact (and, with --witness, as witnessed). 1: tampered (or unreadable), with the
    first bad record named.
    """
    key_path = key if key is not None else log.parent / PUBLIC_KEY_NAME
    try:
        verifier = SealVerifier.from_file(key_path)
    except AuditKeyError as exc:
        raise _fail(str(exc)) from None
    if expect_key_id is not None and verifier.key_id != expect_key_id:
        raise _fail(f"{key_path} has key id {verifier.key_id}, expected {expect_key_id}")
    max_age = None if max_seal_age_s is None else timedelta(seconds=max_seal_age_s)
    # The log with its rotated segments (<log>.1 ..), each continuing the one before; or one file
    # against a seal file given by hand.
    result = (
        verify_segments(log, verifier, max_seal_age=max_age)
        if seal is None
        else verify_log(log, verifier, seal_path=seal, max_seal_age=max_age)
    )
    witnessed: WitnessResult | None = None
    if witness is not None and result.ok:
        try:
            witnessed = check_witnessed(log, witness)
        except (OSError, ValueError) as exc:
            raise _fail(f"cannot read the witness log: {exc}") from None
    console = new_console()
    if as_json:
        verdict = {"log": str(log), **dataclasses.asdict(result)}
        if witnessed is not None:
            verdict["witness"] = {"log": str(witness), **dataclasses.asdict(witnessed)}
        typer.echo(json.dumps(verdict, indent=2))
        if not result.ok or (witnessed is not None and not witnessed.ok):
            raise typer.Exit(1)
        return
    if not result.ok:
        where = f"first bad record: {result.first_bad}: " if result.first_bad is not None else ""
        raise _fail(f"TAMPERED {log}: {where}{result.reason}")
    if witnessed is not None and not witnessed.ok:
        raise _fail(f"NOT AS WITNESSED {log}: {witnessed.reason}")
    console.print(
        f"OK {escape(str(log))}: records {result.first_record}..{result.records}"
        + (" (older segments rotated away)" if result.first_record > 1 else "")
        + f", sealed through record {result.sealed_through} "
        f"at {result.sealed_at} by key {result.key_id}; {result.unsealed_tail} later record(s) protected "
        "by the hash chain only",
        soft_wrap=True,
    )
    if witnessed is not None:
        console.print(
            f"WITNESSED {escape(str(log))}: {witnessed.heads} head(s) recorded by {witnessed.witness}; the "
            f"log is as witnessed through record {witnessed.witnessed_through} (at {witnessed.witnessed_at})",
            soft_wrap=True,
        )


def _epoch(value: str | None, name: str) -> float:
    if not value:
        return 0.0
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise typer.BadParameter(f"{name} must be an ISO 8601 time, got {value!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


@app.command()
def show(
    log: Annotated[Path, typer.Argument(help="The audit.log file to read.")],
    account: Annotated[str, typer.Option(help="Only this account.")] = "",
    job: Annotated[str, typer.Option(help="Only this job id.")] = "",
    event: Annotated[str, typer.Option(help="Only this event; a trailing '.' makes it a prefix.")] = "",
    since: Annotated[str | None, typer.Option(help="ISO 8601 time, inclusive.")] = None,
    until: Annotated[str | None, typer.Option(help="ISO 8601 time, exclusive.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=MAX_LIMIT)] = 1000,
) -> None:
    """Print matching records, one JSON object per line (does not verify; use `verify`)."""
    where = AuditFilter(account, job, event, _epoch(since, "--since"), _epoch(until, "--until"))
    try:
        result = query_log(log, where, limit)
    except OSError as exc:
        raise _fail(f"cannot read {log}: {exc}") from None
    for record in result.records:
        typer.echo(json.dumps(record, sort_keys=True, separators=(",", ":")))
    if result.truncated:
        new_console(stderr=True).print(
            f"[yellow]more than {limit} records matched; showing the oldest {limit}[/]"
        )


@app.command()
def query(
    switch: Annotated[
        str,
        typer.Option(help="host:port of a service's internal port serving AuditLog (switch, auth, data)."),
    ],
    token: Annotated[
        str,
        typer.Option(
            envvar="NEBULA_TOKEN",
            help="Admin token of that cluster. Prefer the NEBULA_TOKEN variable: options show up in `ps`.",
        ),
    ],
    account: Annotated[str, typer.Option(help="Only this account.")] = "",
    job: Annotated[str, typer.Option(help="Only this job id.")] = "",
    event: Annotated[str, typer.Option(help="Only this event; a trailing '.' makes it a prefix.")] = "",
    since: Annotated[str | None, typer.Option(help="ISO 8601 time, inclusive.")] = None,
    until: Annotated[str | None, typer.Option(help="ISO 8601 time, exclusive.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=MAX_LIMIT)] = 1000,
    timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to wait for the answer.")] = 10.0,
    service: Annotated[
        str,
        typer.Option(
            help="The service at that address (its certificate is checked): switch, auth, data, trainer."
        ),
    ] = "switch",
) -> None:
    """Read a running service's audit log over nebula.v1.AuditLog/Query; one JSON object per line.

    The service checks the token (admins only) and audits the query itself. Exit code 1 when the
    call is refused or the service is unreachable.
    """
    request = audit_pb2.AuditQuery(
        account=account,
        job_id=job,
        event=event,
        since_unix=_epoch(since, "--since"),
        until_unix=_epoch(until, "--until"),
        limit=limit,
    )
    try:
        # TLS verifying the CA in NEBULA_CA_CERT, pinned to the service named by --service.
        channel = internal_channel(switch, service=service)
    except InternalTlsError as exc:
        raise _fail(str(exc)) from None
    try:
        reply = audit_pb2_grpc.AuditLogStub(channel).Query(
            request, metadata=bearer_metadata(token), timeout=timeout
        )
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        name = code.name if code is not None else "error"
        raise _fail(f"audit query at {switch} failed: {name}: {details}") from None
    finally:
        channel.close()
    for line in reply.records_json:
        # Re-encoded compactly so the output is one record per line whatever the service stored.
        typer.echo(json.dumps(json.loads(line), sort_keys=True, separators=(",", ":")))
    if reply.truncated:
        new_console(stderr=True).print(
            f"[yellow]more than {limit} records matched; showing the oldest {limit} "
            f"(log holds {reply.total_records})[/]"
        )
