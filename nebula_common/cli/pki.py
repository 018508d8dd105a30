"""``nebula pki`` commands: one organisation's PKI, the CA exchange with peers, and inspection."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated

import typer
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from rich.console import Console
from rich.markup import escape

from nebula_common.cli.console import new_console
from nebula_common.cli.pki_args import (
    check_cluster,
    check_clusters,
    check_optional_cluster,
    fail,
    parse_clusters,
)
from nebula_common.cli.pki_trust import trust_app
from nebula_common.pki.identity import KNOWN_ROLES
from nebula_common.pki.lifecycle import issue_leaf, renew_switch_certificate, revoke_certificate
from nebula_common.pki.store import (
    ClusterPaths,
    PkiError,
    init_cluster,
    init_pki,
)
from nebula_common.pki.trust import export_ca

app = typer.Typer(help="Certificates for the clusters' switches.", no_args_is_help=True)


@app.command()
def init(
    pki_dir: Annotated[Path, typer.Option("--dir", help="PKI root directory (created if missing).")],
    cluster: Annotated[
        str | None,
        typer.Option(
            help="ONE organisation's cluster id: its CA and switch only (no peer).",
            callback=check_optional_cluster,
        ),
    ] = None,
    clusters: Annotated[
        str | None,
        typer.Option(
            help="Demo: comma-separated cluster ids, e.g. 'a,b', all in one directory.",
            callback=check_clusters,
        ),
    ] = None,
    leaf_validity_hours: Annotated[
        int, typer.Option(min=1, help="Lifetime of each switch certificate, in hours.")
    ] = 168,
    force: Annotated[
        bool, typer.Option("--force", help="Regenerate every CA and certificate, replacing existing ones.")
    ] = False,
) -> None:
    """Create one organisation's CA and switch certificate (--cluster), or a demo PKI (--clusters a,b).

    With --cluster nothing about any peer is created: export your CA (`nebula pki export-ca`) and add
    the peer's (`nebula pki trust add`). --clusters runs the same steps for every cluster and trusts
    each other's CAs. An existing complete PKI is reused unchanged, so this is safe to run repeatedly.
    """
    if (cluster is None) == (clusters is None):
        raise typer.BadParameter("give exactly one of --cluster (one organisation) or --clusters a,b (demo)")
    validity = timedelta(hours=leaf_validity_hours)
    console = new_console()
    if cluster is not None:
        try:
            paths, created = init_cluster(pki_dir, cluster, leaf_validity=validity, force=force)
        except (PkiError, OSError) as exc:
            raise fail(str(exc)) from None
        verb = "Wrote" if created else "Reusing existing"
        console.print(f"[bold]{verb} PKI of cluster {cluster} at {escape(str(paths.dir))}[/]", soft_wrap=True)
        console.print(f"  switch identity: {paths.switch_identity.uri}", soft_wrap=True)
        for path in (paths.ca_cert, paths.ca_key, paths.switch_cert, paths.switch_key, paths.crl):
            console.print(f"  {escape(str(path))}", soft_wrap=True)
        console.print(
            f"next: `nebula pki export-ca --dir {escape(str(pki_dir))} --cluster {cluster} --out "
            f"{cluster}-ca.crt`, send the file to the peer organisation and read them its fingerprint.",
            soft_wrap=True,
        )
        return
    assert clusters is not None
    ids = parse_clusters(clusters)
    try:
        layout = init_pki(pki_dir, ids, leaf_validity=validity, force=force)
    except (PkiError, OSError) as exc:
        raise fail(str(exc)) from None

    verb = "Wrote" if layout.created else "Reusing existing"
    console.print(f"[bold]{verb} PKI at {escape(str(layout.root))}[/]", soft_wrap=True)
    for cid in layout.cluster_ids:
        paths = layout.cluster(cid)
        console.print(
            f"\n[bold cyan]cluster {cid}[/]  switch identity: {paths.switch_identity.uri}", soft_wrap=True
        )
        files = [paths.ca_cert, paths.ca_key, paths.switch_cert, paths.switch_key]
        files += [*sorted(paths.trust_dir.glob("*.crt")), paths.trust_bundle]
        for path in files:
            console.print(f"  {escape(str(path))}", soft_wrap=True)


@app.command("export-ca")
def export_ca_command(
    pki_dir: Annotated[Path, typer.Option("--dir", help="PKI root directory.")],
    cluster: Annotated[str, typer.Option(help="Your cluster id.", callback=check_cluster)],
    out: Annotated[Path, typer.Option(help="File (or directory) to write the CA certificate to.")],
) -> None:
    """Write your cluster's CA certificate (public, safe to send) and print its SHA-256 fingerprint.

    Send the file any way you like; read the fingerprint to the peer organisation over a second
    channel (a call), so they can check the file with `nebula pki trust add --fingerprint`.
    """
    try:
        path, fingerprint = export_ca(pki_dir, cluster, out)
    except (PkiError, OSError) as exc:
        raise fail(str(exc)) from None
    new_console(stderr=True).print(
        f"wrote the CA certificate of cluster {cluster} to {escape(str(path))}", soft_wrap=True
    )
    typer.echo(fingerprint)


app.add_typer(trust_app, name="trust")


def _describe(console: Console, title: str, path: Path) -> None:
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except FileNotFoundError:
        raise fail(f"missing certificate {path}") from None
    except ValueError as exc:
        raise fail(f"{path} is not a PEM certificate: {exc}") from None

    now = datetime.now(UTC)
    if now < cert.not_valid_before_utc:
        status = "[yellow]not yet valid[/]"
    elif now >= cert.not_valid_after_utc:
        status = "[red]expired[/]"
    else:
        status = "[green]valid[/]"
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = [f"URI:{v}" for v in san.get_values_for_type(x509.UniformResourceIdentifier)]
        names += [f"DNS:{v}" for v in san.get_values_for_type(x509.DNSName)]
        san_text = ", ".join(names) or "(empty)"
    except x509.ExtensionNotFound:
        san_text = "(none)"

    console.print(f"\n[bold]{escape(title)}[/]  {escape(str(path))}", soft_wrap=True)
    rows = [
        ("subject", escape(cert.subject.rfc4514_string())),
        ("issuer", escape(cert.issuer.rfc4514_string())),
        ("SAN", escape(san_text)),
        ("serial", f"{cert.serial_number:x}"),
        ("not before", cert.not_valid_before_utc.isoformat()),
        ("not after", f"{cert.not_valid_after_utc.isoformat()} ({status})"),
        ("sha256", cert.fingerprint(hashes.SHA256()).hex(":")),
    ]
    for label, value in rows:
        console.print(f"  {label:<11} {value}", soft_wrap=True)


@app.command()
def show(
    pki_dir: Annotated[Path, typer.Option("--dir", help="PKI root directory.")],
    cluster: Annotated[str, typer.Option(help="Cluster whose certificates to show.", callback=check_cluster)],
) -> None:
    """Print subject, SAN, serial and validity of a cluster's CA, switch and trusted peer CAs.

    The SHA-256 fingerprints are what two organisations compare out of band when exchanging CAs.
    """
    paths = ClusterPaths.for_cluster(pki_dir, cluster)
    if not paths.dir.is_dir():
        raise fail(f"no PKI for cluster {cluster!r}: {paths.dir} does not exist")
    console = new_console()
    _describe(console, f"cluster {cluster} CA", paths.ca_cert)
    _describe(console, f"cluster {cluster} switch", paths.switch_cert)
    trusted = sorted(paths.trust_dir.glob("*.crt"))
    if not trusted:
        console.print(f"\n[yellow]cluster {cluster} trusts no peer CA yet[/]")
    for path in trusted:
        _describe(console, f"trusted CA of peer {path.stem}", path)


def _serial_of(serial: str | None, cert: Path | None) -> int:
    if (serial is None) == (cert is None):
        raise typer.BadParameter(
            "give exactly one of --serial (hex, as `nebula pki show` prints it) or --cert"
        )
    if cert is not None:
        try:
            return x509.load_pem_x509_certificate(cert.read_bytes()).serial_number
        except FileNotFoundError:
            raise fail(f"missing certificate {cert}") from None
        except ValueError as exc:
            raise fail(f"{cert} is not a PEM certificate: {exc}") from None
    assert serial is not None
    try:
        value = int(serial.replace(":", ""), 16)
    except ValueError:
        raise typer.BadParameter(f"--serial must be hexadecimal, got {serial!r}") from None
    if value <= 0:
        raise typer.BadParameter("--serial must be positive")
    return value


@app.command()
def revoke(
    pki_dir: Annotated[Path, typer.Option("--dir", help="PKI root directory.")],
    cluster: Annotated[
        str, typer.Option(help="Cluster whose CA issued the certificate.", callback=check_cluster)
    ],
    serial: Annotated[str | None, typer.Option(help="Serial number in hex.")] = None,
    cert: Annotated[Path | None, typer.Option(help="PEM certificate to revoke.")] = None,
    reason: Annotated[str, typer.Option(help="Why (recorded in the CA's audit log).")] = "",
) -> None:
    """Revoke a certificate: re-sign the CA's CRL (the cluster's switch sends it to the peer's).

    The switch of this cluster (NEBULA_SWITCH_OWN_CRL) sends the new CRL over the WAN port; the peer
    switch verifies it against this CA and refuses the certificate at once, closing a live link
    that authenticated with it. In a demo PKI (all clusters in one directory) each peer's
    trust/<id>.crl.pem copy is updated too.
    """
    number = _serial_of(serial, cert)
    try:
        written = revoke_certificate(pki_dir, cluster, number, reason=reason)
    except (PkiError, OSError) as exc:
        raise fail(str(exc)) from None
    console = new_console()
    console.print(f"revoked serial {number:x} of cluster {cluster}; wrote:", soft_wrap=True)
    for path in written:
        console.print(f"  {escape(str(path))}", soft_wrap=True)


@app.command()
def renew(
    pki_dir: Annotated[Path, typer.Option("--dir", help="PKI root directory.")],
    cluster: Annotated[
        str, typer.Option(help="Cluster whose switch certificate to renew.", callback=check_cluster)
    ],
    validity_hours: Annotated[float, typer.Option(min=0.001, help="Lifetime of the new certificate.")] = 24.0,
) -> None:
    """Give a cluster's switch a new key and certificate; a running switch hot-reloads them."""
    try:
        cert_obj = renew_switch_certificate(pki_dir, cluster, validity=timedelta(hours=validity_hours))
    except (PkiError, OSError, ValueError) as exc:
        raise fail(str(exc)) from None
    new_console().print(
        f"renewed switch of cluster {cluster}: serial {cert_obj.serial_number:x}, "
        f"valid until {cert_obj.not_valid_after_utc.isoformat()}",
        soft_wrap=True,
    )


@app.command()
def issue(
    pki_dir: Annotated[Path, typer.Option("--dir", help="PKI root directory.")],
    cluster: Annotated[
        str, typer.Option(help="Cluster whose CA issues the certificate.", callback=check_cluster)
    ],
    role: Annotated[str, typer.Option(help=f"One of: {', '.join(sorted(KNOWN_ROLES))}.")],
    out: Annotated[Path, typer.Option(help="Directory for <role>.crt and <role>.key.")],
    validity_hours: Annotated[float, typer.Option(min=0.001, help="Lifetime of the certificate.")] = 24.0,
) -> None:
    """Issue a leaf for a service or operator (spiffe://nebula/cluster/<id>/<role>)."""
    if role not in KNOWN_ROLES:
        raise typer.BadParameter(f"--role must be one of {', '.join(sorted(KNOWN_ROLES))}, got {role!r}")
    try:
        cert_path, key_path = issue_leaf(
            pki_dir, cluster, role, out, validity=timedelta(hours=validity_hours)
        )
    except (PkiError, OSError, ValueError) as exc:
        raise fail(str(exc)) from None
    new_console().print(f"wrote {escape(str(cert_path))} and {escape(str(key_path))}", soft_wrap=True)
