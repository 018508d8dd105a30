"""Every key has one owner in the compose deployment: what each service's process can open, listed.

    bash docker/run-smoke.sh          # runs this on the same deployment, after docker/smoke_tls.py
    .venv/bin/python docker/smoke_secrets.py --compose "podman-compose -p nebula"

Inside every running service container, as the user the service runs as, a probe walks the whole
filesystem it sees (not the kernel's and the image's own trees: /proc, /sys, /dev, /usr, /lib, ...)
and lists each file it can read that holds a secret: a PEM private key of any kind, or an admin
password file. Then the listing must show

1. no secret readable in two containers (each key has exactly one owner);
2. no container reading a cluster CA key (only the one-shot ``pki-init`` holds it, in its own volume);
3. the admin password only in ``auth-<c>``; the WAN key only in ``switch-<c>``; auth's token-signing
   key only in ``auth-<c>``; the audit seal keys of auth, data, the switch and the trainer only in
   ``signer-<c>`` (no service can re-sign its own past);
4. every service holding its own internal identity key, and the signer its four seal keys (so the
   probe does see what it should).

Prints the listing as JSON (container -> secrets with path, kind and a short digest); exits 1 naming
every violation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

# Runs inside each service container with the image's Python, as the service's user.
PROBE = r"""
import hashlib, json, os
SKIP = {"/proc", "/sys", "/dev", "/usr", "/lib", "/lib64", "/bin", "/sbin", "/boot", "/var/lib/dpkg",
        "/var/cache", "/var/log", "/etc/ssl", "/usr/share"}
found = []
for root, dirs, files in os.walk("/", onerror=lambda exc: None):
    dirs[:] = [d for d in dirs if os.path.join(root, d) not in SKIP]
    for name in files:
        path = os.path.join(root, name)
        try:
            if not os.path.isfile(path) or os.path.getsize(path) > 65536:
                continue
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError:
            continue
        kind = "private key" if b"PRIVATE KEY-----" in data else ""
        if name == "admin-password":
            kind = "password"
        if kind:
            found.append({"path": path, "kind": kind, "sha256": hashlib.sha256(data).hexdigest()})
print(json.dumps({"uid": os.getuid(), "secrets": found}))
"""

SERVICES = ("auth", "codec", "data", "switch", "trainer")
AUDITED = ("auth", "data", "switch", "trainer")
SIGNER_KEY = "/var/lib/nebula/signer/{}/audit-key.pem"


def run(command: list[str], timeout: float = 180) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise SystemExit(
            f"smoke_secrets: {' '.join(command[:6])} ... failed ({result.returncode}): {result.stderr}"
        )
    return result.stdout


def probe(compose: list[str], service: str) -> dict[str, Any]:
    out = run([*compose, "exec", "-T", service, "python", "-c", PROBE])
    return json.loads(out.strip().splitlines()[-1])


def digest_of(compose: list[str], service: str, path: str) -> str:
    """SHA-256 of a file as ``service`` reads it (for naming which key a digest is)."""
    code = f"import hashlib; print(hashlib.sha256(open({path!r}, 'rb').read()).hexdigest())"
    out = run([*compose, "exec", "-T", service, "python", "-c", code])
    return out.strip().splitlines()[-1]


def ca_key_digests(project: str) -> dict[str, str]:
    """Digest -> cluster of each CA key in the pki volume (read from the host: it is no service's)."""
    out = run(["podman", "volume", "inspect", f"{project}_pki", "--format", "{{.Mountpoint}}"])
    root = Path(out.strip())
    return {hashlib.sha256(p.read_bytes()).hexdigest(): p.parent.name for p in root.glob("*/ca.key")}


def violations(
    listing: dict[str, dict[str, Any]], ca_keys: dict[str, str], owned: dict[str, str]
) -> list[str]:
    """``owned``: digest -> the one container that must be the only reader of it."""
    bad = []
    readers: dict[str, list[str]] = {}
    for container, found in listing.items():
        for secret in found["secrets"]:
            readers.setdefault(secret["sha256"], []).append(f"{container}:{secret['path']}")
    for digest, where in sorted(readers.items()):
        if len({w.split(":")[0] for w in where}) > 1:
            bad.append(f"one secret readable in several containers: {where}")
        if digest in ca_keys:
            bad.append(f"cluster {ca_keys[digest]}'s CA key is readable in {where}")
        if digest in owned and any(not w.startswith(owned[digest] + ":") for w in where):
            bad.append(f"{owned[digest]}'s secret is readable in {where}")
    for container, found in listing.items():
        paths = {s["path"] for s in found["secrets"]}
        if container.startswith("signer-"):
            missing = [SIGNER_KEY.format(log) for log in AUDITED if SIGNER_KEY.format(log) not in paths]
            if missing:
                bad.append(f"{container} cannot read the seal keys it holds (is the probe blind?): {missing}")
        elif "/etc/nebula/internal-tls/service.key" not in paths:
            bad.append(f"{container} cannot read its own identity key (is the probe blind?): {sorted(paths)}")
    if len(ca_keys) < 2:
        bad.append(f"found {len(ca_keys)} CA keys in the pki volume, expected one per cluster")
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description="What each compose service can open: one owner per key.")
    parser.add_argument("--compose", default="podman-compose -p nebula")
    parser.add_argument("--clusters", default="ab")
    args = parser.parse_args()
    compose = shlex.split(args.compose)
    project = compose[compose.index("-p") + 1] if "-p" in compose else "nebula"
    containers = [f"{s}-{c}" for c in args.clusters for s in (*SERVICES, "signer")]
    listing = {name: probe(compose, name) for name in containers}
    owned: dict[str, str] = {}
    for cluster in args.clusters:
        owned[digest_of(compose, f"auth-{cluster}", "/etc/nebula/admin/admin-password")] = f"auth-{cluster}"
        owned[digest_of(compose, f"auth-{cluster}", "/var/lib/nebula/auth/signing-key.pem")] = (
            f"auth-{cluster}"
        )
        owned[digest_of(compose, f"switch-{cluster}", "/etc/nebula/tls/tls.key")] = f"switch-{cluster}"
        for log in AUDITED:
            owned[digest_of(compose, f"signer-{cluster}", SIGNER_KEY.format(log))] = f"signer-{cluster}"
    bad = violations(listing, ca_key_digests(project), owned)
    summary = {
        c: sorted(f"{s['path']} ({s['kind']}, {s['sha256'][:12]})" for s in found["secrets"])
        for c, found in listing.items()
    }
    print(json.dumps({"readable_secrets": summary, "violations": bad}, indent=2))
    for line in bad:
        print(f"smoke_secrets: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
