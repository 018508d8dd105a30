"""Give each container only its own secrets (compose one-shot `pki-init`, after `nebula pki init`).

``nebula pki init --dir /pki`` keeps every cluster's CA key, switch key and trust bundle in one
tree. No service should mount that tree: a switch that can read a CA key can mint certificates.
This script copies, per cluster ``<c>``:

    /pki/<c>/switch.crt        -> <out>/switch-<c>/tls.crt
    /pki/<c>/switch.key        -> <out>/switch-<c>/tls.key
    /pki/<c>/trust-bundle.pem  -> <out>/switch-<c>/trust-bundle.pem
    /pki/<c>/trust/<peer>.crl.pem -> <out>/switch-<c>/peer-crl.pem  (the peer CA's CRL)
                               (three or more clusters: peer-crl-<peer>.pem, one per peer)
    /pki/<c>/admin-password    -> <out>/auth-<c>/admin-password   (generated once if absent)
    /pki/<c>/services/<svc>/{ca.crt,service.crt,service.key}
                               -> <out>/<svc>-<c>-internal-tls/   (each service's internal identity)
    /pki/<c>/crl.pem           -> <out>/<svc>-<c>-internal-tls/crl.pem (the cluster CA's CRL: the
                                  service refuses client certificates it lists, NEBULA_<SVC>_INTERNAL_CRL)
    /pki/<c>/services/worker/  -> <out>/worker-<c>-internal-tls/  (only when that volume is mounted:
                                  the cluster ranks' identity for the trainer's rank store)
    /pki/<c>/services/monitoring/ -> <out>/monitoring-<c>-tls/  (only when mounted: the identity the
                                  cluster's Prometheus reads every service's /metrics with)
    /pki/<c>/grafana-admin-password -> <out>/grafana-<c>-admin/admin-password  (only when mounted;
                                  generated once: the `monitoring` profile's Grafana login)

Service certificates (``spiffe://nebula/cluster/<c>/<svc>``, for the mutual TLS of the internal
ports) are issued here by the cluster CA, ``--service-validity-hours`` long (168), and kept while
more than a third of that is left; re-running pki-init renews them, and the running services pick
the new files up before their next handshake (no restart, no dropped call).

The names match the Kubernetes Secrets (``nebula-switch-tls``: tls.crt, tls.key, trust-bundle.pem),
so the services' NEBULA_* settings are the same in compose and in k8s. Each ``<out>/<svc>-<c>`` is
its own named volume, mounted read-only into that one service. Files are written atomically with
mode 0400 and owned by ``--uid`` (the services' user). The admin password is never printed.

The peer CRL has one fixed name (``peer-crl.pem``) so every switch's NEBULA_SWITCH_PEER_CRL is the
same path in compose and k8s. The switch re-reads it every second, so after ``nebula pki revoke``
re-running pki-init (an atomic rename of the file) is enough to refuse the revoked peer.
Likewise for a revoked *service* certificate (``nebula pki revoke --cluster <c> --serial ...``):
re-running pki-init rewrites every service's ``crl.pem``, which each service re-reads every check
interval (5 s), refusing the revoked leaf on every call.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path


def _write(path: Path, data: bytes, mode: int, uid: int | None, gid: int | None) -> None:
    """Write atomically: temp file created with ``mode`` from its first byte, chown, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
        if uid is not None:
            os.fchown(fd, uid, gid if gid is not None else uid)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _admin_password(cluster_dir: Path, name: str = "admin-password") -> bytes:
    """The cluster's bootstrap admin password (or another, ``name``); created once, reused after."""
    path = cluster_dir / name
    if not path.exists():
        _write(path, secrets.token_urlsafe(24).encode(), 0o600, None, None)
        print(f"pki-init: generated {name} for cluster {cluster_dir.name}")
    return path.read_bytes().strip()


def _peer_crls(src: Path, cluster: str, clusters: list[str]) -> dict[str, Path]:
    """The peer CRL file(s) of this cluster's switch: ``peer-crl.pem`` for its one peer, or with three
    or more clusters (every switch linked to every other) ``peer-crl-<peer>.pem`` for each."""
    peers = [c for c in clusters if c != cluster]
    if not peers:
        raise SystemExit(f"pki-init: cluster {cluster} has no peer among {clusters}")
    if len(peers) == 1:
        return {"peer-crl.pem": src / "trust" / f"{peers[0]}.crl.pem"}
    return {f"peer-crl-{peer}.pem": src / "trust" / f"{peer}.crl.pem" for peer in peers}


SERVICES = ("auth", "codec", "data", "switch", "trainer")


def export_internal(
    pki: Path, out: Path, cluster: str, validity_hours: float, uid: int | None, gid: int | None
) -> None:
    """Issue (or keep) every service's internal certificate and copy it into that service's volume."""
    from datetime import timedelta

    from nebula_common.pki.service_identity import ensure_service_certificates

    targets = {service: out / f"{service}-{cluster}-internal-tls" for service in SERVICES}
    for target in targets.values():
        if not target.is_dir():
            raise SystemExit(f"pki-init: {target} is not mounted (expected a named volume there)")
    crl = pki / cluster / "crl.pem"
    if not crl.is_file():
        raise SystemExit(f"pki-init: missing {crl} (the cluster CA's CRL; run `nebula pki init` first)")
    issued = ensure_service_certificates(pki, cluster, SERVICES, validity=timedelta(hours=validity_hours))
    for service, files in issued.items():
        # Key before certificate: a service reading in between sees a mismatched pair and keeps its old one.
        _write(targets[service] / "ca.crt", files.ca.read_bytes(), 0o400, uid, gid)
        _write(targets[service] / "service.key", files.key.read_bytes(), 0o400, uid, gid)
        _write(targets[service] / "service.crt", files.cert.read_bytes(), 0o400, uid, gid)
        _write(targets[service] / "crl.pem", crl.read_bytes(), 0o400, uid, gid)
    print(f"pki-init: cluster {cluster}: exported internal identities and CRL of {', '.join(SERVICES)}")
    validity = timedelta(hours=validity_hours)
    # The scraper's identity is always kept in /pki: `nebula compose endpoints` hands it to the host.
    scraper = ensure_service_certificates(pki, cluster, ("monitoring",), validity=validity)["monitoring"]
    optional = {
        "worker": out
        / f"worker-{cluster}-internal-tls",  # where cluster ranks run (docker-compose.ranks.yml)
        "monitoring": out / f"monitoring-{cluster}-tls",  # the `monitoring` profile's Prometheus
    }
    for role, target in optional.items():
        if not target.is_dir():
            continue
        files = (
            scraper
            if role == "monitoring"
            else ensure_service_certificates(pki, cluster, (role,), validity=validity)[role]
        )
        _write(target / "ca.crt", files.ca.read_bytes(), 0o400, uid, gid)
        _write(target / "service.key", files.key.read_bytes(), 0o400, uid, gid)
        _write(target / "service.crt", files.cert.read_bytes(), 0o400, uid, gid)
        print(f"pki-init: cluster {cluster}: exported the {role} identity")


def export(
    pki: Path,
    out: Path,
    clusters: list[str],
    uid: int | None,
    gid: int | None,
    validity_hours: float = 168.0,
) -> None:
    for cluster in clusters:
        src = pki / cluster
        switch_files = {
            "tls.crt": src / "switch.crt",
            "tls.key": src / "switch.key",
            "trust-bundle.pem": src / "trust-bundle.pem",
            **_peer_crls(src, cluster, clusters),
        }
        missing = [str(p) for p in switch_files.values() if not p.is_file()]
        if missing:
            raise SystemExit(f"pki-init: missing PKI files (run `nebula pki init` first): {missing}")
        switch_out = out / f"switch-{cluster}"
        auth_out = out / f"auth-{cluster}"
        for target in (switch_out, auth_out):
            if not target.is_dir():
                raise SystemExit(f"pki-init: {target} is not mounted (expected a named volume there)")
        for name, source in switch_files.items():
            _write(switch_out / name, source.read_bytes(), 0o400, uid, gid)
        _write(auth_out / "admin-password", _admin_password(src), 0o400, uid, gid)
        print(f"pki-init: cluster {cluster}: exported {switch_out} and {auth_out}")
        export_internal(pki, out, cluster, validity_hours, uid, gid)
        grafana_out = out / f"grafana-{cluster}-admin"
        if grafana_out.is_dir():  # the `monitoring` profile's Grafana: its own admin, not the cluster's
            password = _admin_password(src, "grafana-admin-password")
            _write(grafana_out / "admin-password", password, 0o400, uid, gid)
            print(f"pki-init: cluster {cluster}: exported Grafana's admin password")


def export_organisation(pki: Path, out: Path, cluster: str, uid: int | None, gid: int | None) -> None:
    """One organisation's cluster (``docker/compose-organisation.yml``): its own CRL, no peer CRL.

    The switch sends ``crl.pem`` (this CA's CRL) to the peer over the WAN port and receives the
    peer's there, so nothing of the peer but its CA (in ``trust-bundle.pem``) is exported.
    """
    src = pki / cluster
    switch_files = {
        "tls.crt": src / "switch.crt",
        "tls.key": src / "switch.key",
        "trust-bundle.pem": src / "trust-bundle.pem",
        "crl.pem": src / "crl.pem",
    }
    missing = [str(p) for p in switch_files.values() if not p.is_file()]
    if missing:
        raise SystemExit(
            f"pki-export: missing PKI files (run `nebula pki init --cluster {cluster}` and "
            f"`nebula pki trust add` first): {missing}"
        )
    if not (src / "trust-bundle.pem").read_bytes().strip():
        raise SystemExit(
            f"pki-export: cluster {cluster} trusts no peer yet (run `nebula pki trust add` first)"
        )
    switch_out, auth_out = out / "switch", out / "auth"
    for target in (switch_out, auth_out):
        if not target.is_dir():
            raise SystemExit(f"pki-export: {target} is not mounted (expected a named volume there)")
    for name, source in switch_files.items():
        _write(switch_out / name, source.read_bytes(), 0o400, uid, gid)
    _write(auth_out / "admin-password", _admin_password(src), 0o400, uid, gid)
    print(f"pki-export: cluster {cluster}: exported {switch_out} and {auth_out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pki", type=Path, required=True, help="root written by `nebula pki init --dir`")
    parser.add_argument("--out", type=Path, required=True, help="parent of the per-service volumes")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--clusters", help="comma-separated cluster ids, e.g. a,b (both in one PKI root)")
    group.add_argument("--organisation", help="ONE organisation's cluster id (exports to <out>/switch, auth)")
    parser.add_argument("--uid", type=int, default=None, help="owner of the exported files")
    parser.add_argument("--gid", type=int, default=None, help="group of the exported files (default: uid)")
    parser.add_argument(
        "--service-validity-hours",
        type=float,
        default=168.0,
        help="lifetime of the services' internal certificates",
    )
    args = parser.parse_args(argv)
    os.umask(0o077)
    if args.service_validity_hours <= 0:
        parser.error("--service-validity-hours must be positive")
    if args.organisation:
        cluster = args.organisation.strip()
        export_organisation(args.pki, args.out, cluster, args.uid, args.gid)
        export_internal(args.pki, args.out, cluster, args.service_validity_hours, args.uid, args.gid)
        return 0
    clusters = [c.strip() for c in args.clusters.split(",") if c.strip()]
    export(args.pki, args.out, clusters, args.uid, args.gid, args.service_validity_hours)
    return 0


if __name__ == "__main__":
    sys.exit(main())
