"""``nebula pki trust``: which peer organisations' CAs a cluster trusts on the WAN, added only against the
fingerprint the peer read out of band."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from cryptography import x509
from rich.markup import escape

from nebula_common.cli.console import new_console
from nebula_common.cli.pki_args import check_cluster, fail
from nebula_common.pki.fingerprint import parse_fingerprint
from nebula_common.pki.pins import PinnedCa
from nebula_common.pki.store import FingerprintMismatch, PkiError, add_trust, remove_trust
from nebula_common.pki.trust import list_trust

trust_app = typer.Typer(
    help="Which peer organisations' CAs this cluster trusts on the WAN.", no_args_is_help=True
)


@trust_app.command("add")
def trust_add(
    pki_dir: Annotated[Path, typer.Option("--dir", help="PKI root directory.")],
    cluster: Annotated[str, typer.Option(help="Your cluster id.", callback=check_cluster)],
    peer: Annotated[str, typer.Option(help="The peer organisation's cluster id.", callback=check_cluster)],
    ca: Annotated[Path, typer.Option("--ca", help="The peer's CA certificate (from its `pki export-ca`).")],
    fingerprint: Annotated[
        str, typer.Option(help="The SHA-256 fingerprint the peer read to you out of band (SHA256:AB:CD:...).")
    ],
) -> None:
    """Trust a peer organisation's CA, only if its fingerprint matches what they told you.

    A mismatch is refused (exit 2) and nothing is written. A running switch picks the new trust up
    for new connections within seconds.
    """
    try:
        expected = parse_fingerprint(fingerprint)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--fingerprint'") from None
    try:
        pem = ca.read_bytes()
    except FileNotFoundError:
        raise typer.BadParameter(f"{ca} does not exist", param_hint="'--ca'") from None
    except OSError as exc:
        raise fail(f"cannot read {ca}: {exc}") from None
    try:
        path = add_trust(pki_dir, cluster, peer, pem, expected_fingerprint=expected)
    except FingerprintMismatch as exc:
        new_console(stderr=True).print(f"[bold red]refused:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(code=2) from None
    except (PkiError, OSError) as exc:
        raise fail(str(exc)) from None
    scope = PinnedCa(x509.load_pem_x509_certificate(path.read_bytes()), peer).scope()
    new_console().print(
        f"cluster {cluster} now trusts peer {peer} ({escape(str(path))}); it may certify {scope}",
        soft_wrap=True,
    )


@trust_app.command("list")
def trust_list(
    pki_dir: Annotated[Path, typer.Option("--dir", help="PKI root directory.")],
    cluster: Annotated[str, typer.Option(help="Your cluster id.", callback=check_cluster)],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """The peer CAs this cluster trusts, with the fingerprints to compare and what each may certify."""
    try:
        peers = list_trust(pki_dir, cluster)
    except (PkiError, OSError) as exc:
        raise fail(str(exc)) from None
    if as_json:
        typer.echo(json.dumps([p.as_dict() for p in peers], indent=2))
        return
    if not peers:
        typer.echo(f"cluster {cluster} trusts no peer CA")
        return
    for p in peers:
        if p.crl_error is not None:
            crl = f"unreadable CRL: {p.crl_error}"
        elif p.crl_number is not None:
            crl = f"CRL #{p.crl_number}"
        else:
            crl = "no CRL file (the switch gets it over the link)"
        typer.echo(f"{p.peer}  {p.fingerprint}  until {p.not_after.isoformat()}  {crl}")
        typer.echo(f"    may certify: {p.scope}")


@trust_app.command("remove")
def trust_remove(
    pki_dir: Annotated[Path, typer.Option("--dir", help="PKI root directory.")],
    cluster: Annotated[str, typer.Option(help="Your cluster id.", callback=check_cluster)],
    peer: Annotated[str, typer.Option(help="The peer to stop trusting.", callback=check_cluster)],
) -> None:
    """Stop trusting a peer's CA (offboarding); a running switch closes its link within seconds."""
    try:
        removed = remove_trust(pki_dir, cluster, peer)
    except (PkiError, OSError) as exc:
        raise fail(str(exc)) from None
    new_console().print(f"cluster {cluster} no longer trusts peer {peer}; removed:", soft_wrap=True)
    for path in removed:
        new_console().print(f"  {escape(str(path))}", soft_wrap=True)
