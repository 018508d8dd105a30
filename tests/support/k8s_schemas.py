"""Validate Kubernetes manifests against real schemas, strictly (unknown fields refused).

Core objects (Deployment, Service, NetworkPolicy, ...) use the strict JSON schemas of Kubernetes
that ``kubernetes-validate`` ships (generated from the API server's OpenAPI; loaded once here, where
its own ``validate`` re-reads 1.3 MB of definitions per object). cert-manager objects use the
models that ``cloudcoil-models-cert-manager`` (PyPI, Apache-2.0) generates from cert-manager's own
CRDs (pinned in constraints.txt: cert-manager 1.17), as JSON Schema, made strict the way the API
server treats a structural schema: an object that lists ``properties`` accepts no other field (the
server would prune it silently; ``kubectl apply --validate=strict`` refuses it); ``metadata`` is a
Kubernetes ObjectMeta. Nothing of cert-manager is copied into this repository: the schema comes
from the installed package each run.
"""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Any

import jsonschema
from cloudcoil.models.cert_manager import v1 as cert_manager_v1
from kubernetes_validate.utils import schema_contents

#: The Kubernetes minor the core schemas are taken from (kubectl 1.32 renders these manifests).
K8S_VERSION = "1.32.0"
#: The cert-manager kinds validated here (apiVersion cert-manager.io/v1).
CERT_MANAGER_KINDS = ("Certificate", "Issuer")
OBJECT_META = "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
CERT_MANAGER_PREFIX = "cert-manager."  # keeps the models' $defs apart from Kubernetes' own


def strict_schema(kind: str) -> dict[str, Any]:
    """cert-manager's ``kind`` (v1) as a JSON Schema in which unknown fields are errors."""
    model = getattr(cert_manager_v1, kind)
    schema = model.model_json_schema(by_alias=True, mode="validation")
    text = json.dumps(schema).replace('"#/$defs/', f'"#/$defs/{CERT_MANAGER_PREFIX}')
    schema = json.loads(text)
    defs = {f"{CERT_MANAGER_PREFIX}{name}": sub for name, sub in schema.pop("$defs", {}).items()}

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            options = node.get("anyOf")
            if isinstance(options, list) and len(options) == 2 and {"type": "null"} in options:
                # Optional[X]: a manifest field is absent or an X, never null; one schema, so an
                # error names the field and what it must be instead of "not valid under any of".
                node.pop("anyOf")
                node.update(next(o for o in options if o != {"type": "null"}))
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(schema)
    visit(defs)
    schema["properties"]["metadata"] = {"$ref": OBJECT_META}  # Kubernetes' own, strict
    schema["properties"]["apiVersion"] = {"enum": ["cert-manager.io/v1"]}
    schema["properties"]["kind"] = {"enum": [kind]}
    schema["required"] = sorted({"apiVersion", "kind", "metadata", "spec", *schema.get("required", [])})
    schema["$defs"] = defs
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
    schema = strict_schema(kind)
    jsonschema.Draft202012Validator.check_schema(schema)  # before the (large, trusted) definitions
    return jsonschema.Draft202012Validator({**schema, "$defs": {**_definitions(), **schema["$defs"]}})


def _where(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top level)"


def errors(doc: dict[str, Any]) -> list[str]:
    """Every schema violation of one manifest, as "Kind name: path: message"; [] if valid.

    A kind with no schema here (neither core Kubernetes nor a cert-manager kind) is itself an error.
    """
    kind = doc.get("kind", "?")
    name = (doc.get("metadata") or {}).get("name", "?")
    api_version = str(doc.get("apiVersion", ""))
    if api_version == "cert-manager.io/v1":
        if kind not in CERT_MANAGER_KINDS:
            return [f"{kind} {name}: no cert-manager schema for this kind here (only {CERT_MANAGER_KINDS})"]
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
