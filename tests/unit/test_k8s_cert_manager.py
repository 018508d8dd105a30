"""k8s/components/cert-manager and the per-organisation overlays (k8s/overlays/org-a, org-b).

Rendered with ``kubectl kustomize`` when kubectl is installed (skipped otherwise; the component's own
files are still checked). The Issuer and Certificate are validated against the fields, required
properties and enums of cert-manager's ``cert-manager.io/v1`` CRDs that they use (an offline subset:
no cluster to apply them to). A certificate carrying exactly the rendered names, signed by a CA from
``nebula pki init --cluster``, is what the switch accepts as its identity and what a peer's TLS
verification (with the CA's name constraint) accepts.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from cryptography.x509.verification import PolicyBuilder, Store

from nebula_common.pki import Identity, identity_from_certificate
from nebula_common.pki.store import _read_key, init_cluster
from services.switch.config import SwitchSettings

ROOT = Path(__file__).resolve().parents[2]
COMPONENT = ROOT / "k8s" / "components" / "cert-manager"
ORG_OVERLAYS = {"a": ROOT / "k8s" / "overlays" / "org-a", "b": ROOT / "k8s" / "overlays" / "org-b"}

# cert-manager.io/v1 (CRDs of cert-manager 1.x): the properties a Certificate/Issuer spec may have and
# the enums of the fields this repository sets.
CERTIFICATE_SPEC = {
    "additionalOutputFormats", "commonName", "dnsNames", "duration", "emailAddresses",
    "encodeUsagesInRequest", "ipAddresses", "isCA", "issuerRef", "keystores", "literalSubject",
    "nameConstraints", "otherNames",
    "privateKey", "renewBefore", "renewBeforePercentage", "revisionHistoryLimit", "secretName",
    "secretTemplate", "signatureAlgorithm", "subject", "uris", "usages",
}  # fmt: skip
KEY_USAGES = {
    "signing", "digital signature", "content commitment", "key encipherment", "key agreement",
    "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any", "server auth",
    "client auth", "code signing", "email protection", "s/mime", "ipsec end system", "ipsec tunnel",
    "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc",
}  # fmt: skip
PRIVATE_KEY = {
    "algorithm": {"RSA", "ECDSA", "Ed25519"},
    "encoding": {"PKCS1", "PKCS8"},
    "rotationPolicy": {"Never", "Always"},
}
ISSUER_TYPES = {"acme", "ca", "selfSigned", "vault", "venafi"}
GO_DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")


def _hours(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
    return (
        sum(float(n) * units[u] for n, _, u in re.findall(r"(\d+(\.\d+)?)(ns|us|µs|ms|s|m|h)", duration))
        / 3600
    )


def validate_certificate(doc: dict[str, Any]) -> None:
    assert doc["apiVersion"] == "cert-manager.io/v1" and doc["kind"] == "Certificate"
    spec = doc["spec"]
    assert set(spec) <= CERTIFICATE_SPEC, f"unknown Certificate fields {set(spec) - CERTIFICATE_SPEC}"
    assert spec["secretName"] and spec["issuerRef"]["name"], "secretName and issuerRef.name are required"
    assert spec["issuerRef"].get("kind", "Issuer") in {"Issuer", "ClusterIssuer"}
    for field in ("duration", "renewBefore"):
        assert GO_DURATION.fullmatch(spec[field]), f"{field} {spec[field]!r} is not a Go duration"
    assert _hours(spec["renewBefore"]) < _hours(spec["duration"]), "renewBefore must be below duration"
    for key, allowed in PRIVATE_KEY.items():
        assert spec["privateKey"][key] in allowed, f"privateKey.{key}={spec['privateKey'][key]!r}"
    assert set(spec["usages"]) <= KEY_USAGES, f"unknown usages {set(spec['usages']) - KEY_USAGES}"
    assert spec.get("dnsNames") or spec.get("uris") or spec.get("commonName"), "a Certificate needs a name"


def validate_issuer(doc: dict[str, Any]) -> None:
    assert doc["apiVersion"] == "cert-manager.io/v1" and doc["kind"] in {"Issuer", "ClusterIssuer"}
    types = set(doc["spec"]) & ISSUER_TYPES
    assert len(types) == 1 and set(doc["spec"]) == types, f"exactly one issuer type, got {set(doc['spec'])}"
    if "ca" in types:
        assert doc["spec"]["ca"]["secretName"], "a CA issuer needs the CA's secretName"


def _render(cluster: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed; the component's files are still checked")
    result = subprocess.run(
        [kubectl, "kustomize", str(ORG_OVERLAYS[cluster])], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def test_component_files_are_valid_cert_manager_objects() -> None:
    docs = {p.name: yaml.safe_load(p.read_text()) for p in COMPONENT.glob("*.yaml")}
    assert docs["kustomization.yaml"]["kind"] == "Component"
    validate_issuer(docs["issuer.yaml"])
    validate_certificate(docs["certificate.yaml"])
    assert docs["certificate.yaml"]["spec"]["issuerRef"]["name"] == docs["issuer.yaml"]["metadata"]["name"]


@pytest.mark.parametrize("cluster", sorted(ORG_OVERLAYS))
def test_org_overlay_renders_issuer_certificate_and_a_switch_reading_them(
    cluster: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = _render(cluster)
    peer = "b" if cluster == "a" else "a"
    (certificate,) = [d for d in docs if d["kind"] == "Certificate"]
    (issuer,) = [d for d in docs if d["kind"] == "Issuer"]
    validate_certificate(certificate)
    validate_issuer(issuer)
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"nebula"}
    spec = certificate["spec"]
    identity = Identity(cluster, "switch")
    assert spec["uris"] == [identity.uri] and spec["dnsNames"] == [identity.dns_name]
    assert spec["privateKey"] == {
        "algorithm": "ECDSA",
        "size": 256,
        "encoding": "PKCS8",
        "rotationPolicy": "Always",
    }
    assert {"server auth", "client auth"} <= set(spec["usages"])  # the switch both accepts and dials

    (switch,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "nebula-switch"]
    pod = switch["spec"]["template"]["spec"]
    (tls,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    sources = {
        s["secret"]["name"]: {i["key"] for i in s["secret"]["items"]} for s in tls["projected"]["sources"]
    }
    assert sources == {
        spec["secretName"]: {"tls.crt", "tls.key"},
        "nebula-switch-trust": {"trust-bundle.pem", "crl.pem"},
    }
    assert tls["projected"]["defaultMode"] & 0o007 == 0
    (config,) = [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("nebula-cluster")
    ]
    env: dict[str, str] = {}
    for item in pod["containers"][0]["env"]:
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif item["valueFrom"]["configMapKeyRef"]["key"] in config["data"]:
            env[item["name"]] = config["data"][item["valueFrom"]["configMapKeyRef"]["key"]]
    assert "NEBULA_SWITCH_PEER_CRL" not in env  # the peer's CRL comes over the link
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = SwitchSettings()
    assert (settings.cluster_id, settings.peer_cluster_id) == (cluster, peer)
    assert settings.own_crl == Path("/etc/nebula/tls/crl.pem") and settings.peer_crl is None
    files = {settings.tls_cert, settings.tls_key, settings.trust_bundle, settings.own_crl}
    assert {f.name for f in files} == {"tls.crt", "tls.key", "trust-bundle.pem", "crl.pem"}

    # What cert-manager would issue from this spec, signed by the organisation's CA (nebula pki init):
    paths, _ = init_cluster(tmp_path, cluster)
    ca = x509.load_pem_x509_certificate(paths.ca_cert.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, spec["commonName"])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(hours=_hours(spec["duration"])))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(n) for n in spec["dnsNames"]]
                + [x509.UniformResourceIdentifier(u) for u in spec["uris"]]
            ),
            critical=False,
        )
        .add_extension(  # cert-manager links the leaf to its issuer's key, as RFC 5280 requires
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(
                ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
            ),
            critical=False,
        )
        .sign(_read_key(paths.ca_key), hashes.SHA256())
    )
    assert identity_from_certificate(leaf) == identity
    verifier = PolicyBuilder().store(Store([ca])).build_server_verifier(x509.DNSName(identity.dns_name))
    verifier.verify(leaf, [])  # chains to the CA within its name constraint, as the peer's TLS checks
    assert key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
