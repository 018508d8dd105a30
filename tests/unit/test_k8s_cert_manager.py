"""k8s/components/cert-manager and the per-organisation overlays (k8s/overlays/org-a, org-b).

Rendered with ``kubectl kustomize`` when kubectl is installed (skipped otherwise; the component's own
files are still checked). Every rendered object is validated strictly against a real schema
(tests/support/k8s_schemas.py): the Issuer and Certificate against cert-manager's ``cert-manager.io/v1``
CRDs (as the PyPI package cloudcoil-models-cert-manager generates them), the core objects against
Kubernetes' own; a misspelled field is refused. What the CRD schema cannot say but cert-manager's
webhook checks (Go durations, renewBefore below duration, exactly one issuer type) is checked here too.
A certificate carrying exactly the rendered names, signed by a CA from ``nebula pki init --cluster``, is
what the switch accepts as its identity and what a peer's TLS verification (with the CA's name
constraint) accepts.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import cache
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
from nebula_common.pki.layout import read_key
from nebula_common.pki.store import init_cluster
from services.switch.config import SwitchSettings
from tests.support import k8s_schemas

ROOT = Path(__file__).resolve().parents[2]
COMPONENT = ROOT / "k8s" / "components" / "cert-manager"
ORG_OVERLAYS = {"a": ROOT / "k8s" / "overlays" / "org-a", "b": ROOT / "k8s" / "overlays" / "org-b"}
ISSUER_TYPES = {"acme", "ca", "selfSigned", "vault", "venafi"}
GO_DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")
WAN_PORT = 7443
RUNTIME_UID = 10001


def _hours(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
    return (
        sum(float(n) * units[u] for n, _, u in re.findall(r"(\d+(\.\d+)?)(ns|us|µs|ms|s|m|h)", duration))
        / 3600
    )


def validate_certificate(doc: dict[str, Any]) -> None:
    """The CRD schema, then what cert-manager's webhook adds to it for the fields this repo sets."""
    assert not k8s_schemas.errors(doc), k8s_schemas.errors(doc)
    spec = doc["spec"]
    for field in ("duration", "renewBefore"):
        assert GO_DURATION.fullmatch(spec[field]), f"{field} {spec[field]!r} is not a Go duration"
    assert _hours(spec["duration"]) >= 1, "cert-manager's minimum duration is 1h"
    assert 5 / 60 <= _hours(spec["renewBefore"]) < _hours(spec["duration"]), "renewBefore in [5m, duration)"
    assert spec.get("dnsNames") or spec.get("uris") or spec.get("commonName"), "a Certificate needs a name"


def validate_issuer(doc: dict[str, Any]) -> None:
    assert not k8s_schemas.errors(doc), k8s_schemas.errors(doc)
    types = set(doc["spec"]) & ISSUER_TYPES
    assert len(types) == 1 and set(doc["spec"]) == types, f"exactly one issuer type, got {set(doc['spec'])}"


@cache
def _kustomize(cluster: str) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed; the component's files are still checked")
    result = subprocess.run(
        [kubectl, "kustomize", str(ORG_OVERLAYS[cluster])], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _render(cluster: str) -> list[dict[str, Any]]:
    """The overlay as `kubectl kustomize` renders it (rendered once per cluster, parsed afresh)."""
    return [d for d in yaml.safe_load_all(_kustomize(cluster)) if d]


def test_component_files_are_valid_cert_manager_objects() -> None:
    docs = {p.name: yaml.safe_load(p.read_text()) for p in COMPONENT.glob("*.yaml")}
    assert docs["kustomization.yaml"]["kind"] == "Component"
    validate_issuer(docs["issuer.yaml"])
    validate_certificate(docs["certificate.yaml"])
    assert docs["certificate.yaml"]["spec"]["issuerRef"]["name"] == docs["issuer.yaml"]["metadata"]["name"]


def test_the_cert_manager_schemas_come_from_its_crds_not_from_this_repository() -> None:
    from importlib.metadata import version

    assert version("cloudcoil.models.cert_manager").startswith("1.17."), "pin: cert-manager 1.17 CRDs"
    for kind in k8s_schemas.CERT_MANAGER_KINDS:
        schema = k8s_schemas.strict_schema(kind)
        assert {"apiVersion", "kind", "metadata", "spec"} <= set(schema["required"]), kind
        assert len(schema["$defs"]) > 10, f"{kind}: the CRD's nested objects are all there"
    assert not (ROOT / "k8s" / "schemas").exists()


@pytest.mark.parametrize("cluster", sorted(ORG_OVERLAYS))
def test_every_rendered_object_validates_strictly(cluster: str) -> None:
    docs = _render(cluster)
    kinds = {d["kind"] for d in docs}
    assert {"Certificate", "Issuer", "Deployment", "Service", "NetworkPolicy", "ConfigMap"} <= kinds, kinds
    found = [error for doc in docs for error in k8s_schemas.errors(doc)]
    assert not found, "\n".join(found)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation: set the dotted ``path`` (list indexes as numbers) to ``value``."""

    def mutate(doc: dict[str, Any]) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        node: Any = doc
        for part in parents:
            node = node[part]
        node[last] = value

    return mutate


def _rename(path: str, new: str) -> Callable[[dict[str, Any]], None]:
    """A mutation: misspell the key at dotted ``path`` as ``new``, keeping its value."""

    def mutate(doc: dict[str, Any]) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        node: Any = doc
        for part in parents:
            node = node[part]
        node[new] = node.pop(last)

    return mutate


# (kind, name, mutation, what the error must mention): each must be refused.
CERT, ISSUER = ("Certificate", "nebula-switch"), ("Issuer", "nebula-ca")
MISTAKES = {
    "certificate dnsName": (*CERT, _rename("spec.dnsNames", "dnsName"), "dnsName"),
    "certificate issuerRef.nam": (*CERT, _rename("spec.issuerRef.name", "nam"), "nam"),
    "certificate privateKey.rotationpolicy": (
        *CERT, _rename("spec.privateKey.rotationPolicy", "rotationpolicy"), "rotationpolicy",
    ),
    "certificate rotationPolicy value": (
        *CERT, _set("spec.privateKey.rotationPolicy", "Sometimes"), "Sometimes",
    ),
    "certificate usage": (*CERT, _set("spec.usages.1", "serverauth"), "serverauth"),
    "certificate size as text": (*CERT, _set("spec.privateKey.size", "256"), "256"),
    "certificate metadata.lables": (*CERT, _rename("metadata.labels", "lables"), "lables"),
    "issuer ca.secretname": (*ISSUER, _rename("spec.ca.secretName", "secretname"), "secretname"),
    "issuer CA": (*ISSUER, _rename("spec.ca", "CA"), "CA"),
    "deployment securityContex": (
        "Deployment", "nebula-switch", _rename("spec.template.spec.securityContext", "securityContex"),
        "securityContex",
    ),
    "service targetport": (
        "Service", "nebula-switch-wan", _rename("spec.ports.0.targetPort", "targetport"), "targetport",
    ),
}  # fmt: skip


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_misspelled_field_is_refused(mistake: str) -> None:
    kind, name, mutate, mentioned = MISTAKES[mistake]
    (doc,) = [d for d in _render("a") if d["kind"] == kind and d["metadata"]["name"] == name]
    assert not k8s_schemas.errors(doc)
    broken = copy.deepcopy(doc)
    mutate(broken)
    found = k8s_schemas.errors(broken)
    assert found and any(mentioned in error for error in found), (mistake, found)


def test_a_misspelled_field_in_the_component_files_is_refused_without_kubectl() -> None:
    certificate = yaml.safe_load((COMPONENT / "certificate.yaml").read_text())
    _rename("spec.privateKey.encoding", "encodng")(certificate)
    assert any("encodng" in error for error in k8s_schemas.errors(certificate))
    issuer = yaml.safe_load((COMPONENT / "issuer.yaml").read_text())
    _set("spec.ca.secretName", 42)(issuer)
    assert any("spec.ca.secretName" in error and "string" in error for error in k8s_schemas.errors(issuer))


def test_an_acme_issuer_is_checked_down_to_its_solvers() -> None:
    issuer = yaml.safe_load((COMPONENT / "issuer.yaml").read_text())
    issuer["spec"] = {
        "acme": {
            "server": "https://acme.example/dir",
            "privateKeySecretRef": {"name": "k"},
            "solvers": [{"http01": {"ingress": {"ingressClassName": "nginx"}}}],
        }
    }
    assert not k8s_schemas.errors(issuer)
    issuer["spec"]["acme"]["solvers"][0]["http01"]["ingress"]["ingresClassName"] = "typo"
    found = k8s_schemas.errors(issuer)
    assert found and any("ingresClassName" in error for error in found), found


@pytest.mark.parametrize("cluster", sorted(ORG_OVERLAYS))
def test_rendered_org_overlay_keeps_the_hardening_of_the_base(cluster: str) -> None:
    """As tests/unit/test_deploy_manifests.py checks the base: the org overlays change none of it."""
    docs = _render(cluster)
    monitoring = ("nebula-prometheus", "nebula-grafana")  # components/monitoring: test_monitoring_manifests
    deployments = [  # the trainer: a StatefulSet
        d
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet") and not d["metadata"]["name"].startswith(monitoring)
    ]
    assert len(deployments) == 5, [d["metadata"]["name"] for d in deployments]
    for deployment in deployments:
        name, pod = deployment["metadata"]["name"], deployment["spec"]["template"]["spec"]
        assert (
            pod["securityContext"]["runAsNonRoot"] is True
            and pod["securityContext"]["runAsUser"] == RUNTIME_UID
        )
        assert pod.get("automountServiceAccountToken") is False and pod.get("enableServiceLinks") is False, (
            name
        )
        for container in pod["containers"]:
            ctx = container["securityContext"]
            assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False, name
            assert ctx["capabilities"]["drop"] == ["ALL"] and not ctx["capabilities"].get("add"), name
            assert {"cpu", "memory"} <= set(container["resources"]["limits"]), name
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                assert "grpc" in container[probe], f"{name}: {probe}"
        for volume in pod["volumes"]:
            source = volume.get("secret") or volume.get("projected")
            if source is not None:
                assert source["defaultMode"] & 0o007 == 0, (
                    f"{name}: volume {volume['name']} readable by others"
                )
    for service in (d for d in docs if d["kind"] == "Service"):
        spec = service["spec"]
        if service["metadata"]["name"] == "nebula-switch-wan":
            assert [p["port"] for p in spec["ports"]] == [WAN_PORT]
        else:
            assert spec.get("type", "ClusterIP") == "ClusterIP", service["metadata"]["name"]
    assert not [d for d in docs if d["kind"] == "Secret"], (
        "no Secret is rendered: they are made at deploy time"
    )


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
        .sign(read_key(paths.ca_key), hashes.SHA256())
    )
    assert identity_from_certificate(leaf) == identity
    verifier = PolicyBuilder().store(Store([ca])).build_server_verifier(x509.DNSName(identity.dns_name))
    verifier.verify(leaf, [])  # chains to the CA within its name constraint, as the peer's TLS checks
    assert key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
