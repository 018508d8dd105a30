"""Validate Kubernetes manifests against real schemas, strictly (unknown fields refused).

Core objects (Deployment, Service, NetworkPolicy, ...) use the strict JSON schemas of Kubernetes
that ``kubernetes-validate`` ships (generated from the API server's OpenAPI; loaded once here, where
its own ``validate`` re-reads 1.3 MB of definitions per object). cert-manager objects
use the CRDs' openAPIV3Schema vendored in k8s/schemas/cert-manager/ (README there: source, version,
licence), turned into JSON Schema the way the API server treats a structural schema: an object that
lists ``properties`` and declares no ``additionalProperties`` or ``x-kubernetes-preserve-unknown-fields``
accepts no other field (the server would prune it silently; ``kubectl apply --validate=strict``
refuses it), and ``metadata`` is a Kubernetes ObjectMeta.
"""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
from kubernetes_validate.utils import schema_contents

ROOT = Path(__file__).resolve().parents[2]
CERT_MANAGER_SCHEMAS = ROOT / "k8s" / "schemas" / "cert-manager"
#: The Kubernetes minor the core schemas are taken from (kubectl 1.32 renders these manifests).
K8S_VERSION = "1.32.0"
#: kind -> vendored schema file, for apiVersion cert-manager.io/v1.
CERT_MANAGER_KINDS = {
    "Certificate": "certificates.cert-manager.io-v1.json",
    "Issuer": "issuers.cert-manager.io-v1.json",
}
NOT_VENDORED = "x-nebula-not-vendored"
OBJECT_META = "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A CRD's structural openAPIV3Schema as JSON Schema in which unknown fields are errors."""
    schema = copy.deepcopy(schema)

    def visit(node: dict[str, Any]) -> dict[str, Any]:
        if node.get(NOT_VENDORED):
            return {"not": {}, "$comment": "this subtree of the CRD is not vendored (k8s/schemas)"}
        if node.get("type") == "object":
            if "properties" in node:
                node["properties"] = {name: visit(sub) for name, sub in node["properties"].items()}
                if "additionalProperties" not in node and not node.get(
                    "x-kubernetes-preserve-unknown-fields"
                ):
                    node["additionalProperties"] = False
            if isinstance(node.get("additionalProperties"), dict):
                node["additionalProperties"] = visit(node["additionalProperties"])
        if node.get("type") == "array" and isinstance(node.get("items"), dict):
            node["items"] = visit(node["items"])
        return node

    schema = visit(schema)
    schema["properties"]["metadata"] = {"$ref": OBJECT_META}  # Kubernetes' own, strict
    return schema


STRICT_DIR = f"kubernetes-json-schema/v{K8S_VERSION}-local-strict"
DEFINITIONS_REF = "/api/_definitions.json#/$defs/"


def _local_refs(schema: Any) -> Any:
    """``schema`` with its references into Kubernetes' _definitions.json made local ("#/$defs/...").

    The definitions are then embedded in each schema: resolving them through a ``referencing``
    registry instead costs about 0.2 s per object validated.
    """
    return json.loads(json.dumps(schema).replace(f'"{DEFINITIONS_REF}', '"#/$defs/'))


@cache
def _definitions() -> dict[str, Any]:
    """Kubernetes' strict definitions, which every core schema and ObjectMeta refer to."""
    return _local_refs(schema_contents(f"{STRICT_DIR}/_definitions.json", K8S_VERSION))["$defs"]


@cache
def _core_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator | None:
    """The strict schema of a core kind, named as kubernetes-validate names it (None if it has none)."""
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)  # apps/v1 -> apps-v1
    try:
        schema = schema_contents(f"{STRICT_DIR}/{kind.lower()}-{group_version}.json", K8S_VERSION)
    except FileNotFoundError:
        return None
    schema = {**_local_refs(schema), "$defs": _definitions()}
    return jsonschema.Draft202012Validator(schema)


@cache
def _cert_manager_validator(kind: str) -> jsonschema.Draft202012Validator:
    crd = json.loads((CERT_MANAGER_SCHEMAS / CERT_MANAGER_KINDS[kind]).read_text())
    schema = strict_schema(crd)
    schema["properties"]["apiVersion"]["enum"] = ["cert-manager.io/v1"]
    schema["properties"]["kind"]["enum"] = [kind]
    schema["required"] = sorted({"apiVersion", "kind", "metadata", *schema.get("required", [])})
    jsonschema.Draft202012Validator.check_schema(schema)  # before the (large, trusted) definitions
    return jsonschema.Draft202012Validator({**schema, "$defs": _definitions()})


def _where(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top level)"


def errors(doc: dict[str, Any]) -> list[str]:
    """Every schema violation of one manifest, as "Kind name: path: message"; [] if valid.

    A kind with no schema here (neither core Kubernetes nor a vendored CRD) is itself an error.
    """
    kind = doc.get("kind", "?")
    name = (doc.get("metadata") or {}).get("name", "?")
    api_version = str(doc.get("apiVersion", ""))
    if api_version == "cert-manager.io/v1":
        if kind not in CERT_MANAGER_KINDS:
            return [f"{kind} {name}: no vendored schema for this kind in k8s/schemas/cert-manager"]
        validator = _cert_manager_validator(kind)
    else:
        found = _core_validator(api_version, kind)
        if found is None:
            return [f"{kind} {name}: no Kubernetes {K8S_VERSION} schema for {api_version} {kind}"]
        validator = found
    return [
        f"{kind} {name}: {_where(e)}: {e.message}"
        + (f" ({e.schema['$comment']})" if isinstance(e.schema, dict) and "$comment" in e.schema else "")
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]
