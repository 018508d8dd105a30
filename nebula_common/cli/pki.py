"""``nebula pki`` commands: create the dev PKI for the clusters' switches and inspect it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated

import typer
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from rich.console import Console
from rich.markup import escape

from nebula_common.pki.identity import KNOWN_ROLES, validate_cluster_id
from nebula_common.pki.store import (
    ClusterPaths,
    PkiError,
    init_pki,
    issue_leaf,
    renew_switch_certificate,
    revoke_certificate,
)

app = typer.Typer(help="Certificates for the clusters' switches.", no_args_is_help=True)


def _fail(message: str) -> typer.Exit:
    """Report an operational error (bad state on disk, unreadable file) as exit code 1."""
    Console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    return typer.Exit(code=1)


def _parse_clusters(value: str) -> list[str]:
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


def _check_clusters(value: str) -> str:
    # Validate during parsing so Typer reports "Invalid value for '--clusters'" with usage help.
    _parse_clusters(value)
    return value


def _check_cluster(value: str) -> str:
    try:
        return validate_cluster_id(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


@app.command()
def init(
    pki_dir: Annotated[Path, typer.Option("--dir", help="PKI root directory (created if missing).")],
    clusters: Annotated[
        str, typer.Option(help="Comma-separated cluster ids, e.g. 'a,b'.", callback=_check_clusters)
    ],
    leaf_validity_hours: Annotated[
        int, typer.Option(min=1, help="Lifetime of each switch certificate, in hours.")
    ] = 168,
    force: Annotated[
        bool, typer.Option("--force", help="Regenerate every CA and certificate, replacing existing ones.")
    ] = False,
) -> None:
    """Create a CA per cluster, issue each switch its certificate, and exchange trust between clusters.

    An existing complete PKI is reused unchanged, so this is safe to run repeatedly.
    """
    ids = _parse_clusters(clusters)
    try:
        layout = init_pki(pki_dir, ids, leaf_validity=timedelta(hours=leaf_validity_hours), force=force)
    except (PkiError, OSError) as exc:
        raise _fail(str(exc)) from None

    console = Console()
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


def _describe(console: Console, title: str, path: Path) -> None:
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except FileNotFoundError:
        raise _fail(f"missing certificate {path}") from None
    except ValueError as exc:
        raise _fail(f"{path} is not a PEM certificate: {exc}") from None

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
    cluster: Annotated[
        str, typer.Option(help="Cluster whose certificates to show.", callback=_check_cluster)
    ],
) -> None:
    """Print subject, SAN, serial and validity of a cluster's CA, switch and trusted peer CAs.

    The SHA-256 fingerprints are what two organisations compare out of band when exchanging CAs.
    """
    paths = ClusterPaths.for_cluster(pki_dir, cluster)
    if not paths.dir.is_dir():
        raise _fail(f"no PKI for cluster {cluster!r}: {paths.dir} does not exist")
    console = Console()
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
            raise _fail(f"missing certificate {cert}") from None
        except ValueError as exc:
            raise _fail(f"{cert} is not a PEM certificate: {exc}") from None
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
        str, typer.Option(help="Cluster whose CA issued the certificate.", callback=_check_cluster)
    ],
    serial: Annotated[str | None, typer.Option(help="Serial number in hex.")] = None,
    cert: Annotated[Path | None, typer.Option(help="PEM certificate to revoke.")] = None,
    reason: Annotated[str, typer.Option(help="Why (recorded in the CA's audit log).")] = "",
) -> None:
    """Revoke a certificate: re-sign the CA's CRL and copy it to every peer that trusts this CA.

    Peer switches poll their copy every second: new connections with the certificate fail and an
    existing link that authenticated with it is closed.
    """
    number = _serial_of(serial, cert)
    try:
        written = revoke_certificate(pki_dir, cluster, number, reason=reason)
    except (PkiError, OSError) as exc:
        raise _fail(str(exc)) from None
    console = Console()
    console.print(f"revoked serial {number:x} of cluster {cluster}; wrote:", soft_wrap=True)
    for path in written:
        console.print(f"  {escape(str(path))}", soft_wrap=True)


@app.command()
def renew(
    pki_dir: Annotated[Path, typer.Option("--dir", help="PKI root directory.")],
    cluster: Annotated[
        str, typer.Option(help="Cluster whose switch certificate to renew.", callback=_check_cluster)
    ],
    validity_hours: Annotated[float, typer.Option(min=0.001, help="Lifetime of the new certificate.")] = 24.0,
) -> None:
    """Give a cluster's switch a new key and certificate; a running switch hot-reloads them."""
    try:
        cert_obj = renew_switch_certificate(pki_dir, cluster, validity=timedelta(hours=validity_hours))
    except (PkiError, OSError, ValueError) as exc:
        raise _fail(str(exc)) from None
    Console().print(
        f"renewed switch of cluster {cluster}: serial {cert_obj.serial_number:x}, "
        f"valid until {cert_obj.not_valid_after_utc.isoformat()}",
        soft_wrap=True,
    )


@app.command()
def issue(
    pki_dir: Annotated[Path, typer.Option("--dir", help="PKI root directory.")],
    cluster: Annotated[
        str, typer.Option(help="Cluster whose CA issues the certificate.", callback=_check_cluster)
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
        raise _fail(str(exc)) from None
    Console().print(f"wrote {escape(str(cert_path))} and {escape(str(key_path))}", soft_wrap=True)
