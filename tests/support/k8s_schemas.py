"""Validate Kubernetes manifests against real schemas, strictly (unknown fields refused).

Core objects (Deployment, Service, NetworkPolicy, ...) use the strict JSON schemas of Kubernetes
that ``kubernetes-validate`` ships (generated from the API server's OpenAPI; loaded once per
Kubernetes version here, where its own ``validate`` re-reads 1.3 MB of definitions per object), for
the version asked (default ``K8S_VERSION``; the newest schema not newer than it, as
``kubernetes-validate`` picks). cert-manager objects use the
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
from kubernetes_validate.utils import all_versions, major_minor, schema_contents

#: The Kubernetes version the core schemas are taken from by default (kubectl 1.32 renders these manifests).
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


DEFINITIONS_REF = "/api/_definitions.json#/$defs/"


def _strict_dir(version: str) -> str:
    """Where kubernetes-validate keeps the strict schemas for ``version`` (the newest not newer)."""
    known = [v for v in all_versions() if major_minor(v) <= major_minor(version)]
    if not known:
        raise ValueError(f"no Kubernetes schemas for version {version} (oldest: {all_versions()[0]})")
    return f"kubernetes-json-schema/v{known[-1]}-local-strict"


def _local_refs(schema: Any) -> Any:
    """``schema`` with its references into Kubernetes' _definitions.json made local ("#/$defs/...").

    The definitions are then embedded in each schema: resolving them through a ``referencing``
    registry instead costs about 0.2 s per object validated.
    """
    return json.loads(json.dumps(schema).replace(f'"{DEFINITIONS_REF}', '"#/$defs/'))


@cache
def _definitions(version: str) -> dict[str, Any]:
    """Kubernetes' strict definitions, which every core schema and ObjectMeta refer to."""
    return _local_refs(schema_contents(f"{_strict_dir(version)}/_definitions.json", version))["$defs"]


@cache
def _core_validator(version: str, api_version: str, kind: str) -> jsonschema.Draft202012Validator | None:
    """The strict schema of a core kind, named as kubernetes-validate names it (None if it has none)."""
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)  # apps/v1 -> apps-v1
    try:
        schema = schema_contents(f"{_strict_dir(version)}/{kind.lower()}-{group_version}.json", version)
    except FileNotFoundError:
        return None
    schema = {**_local_refs(schema), "$defs": _definitions(version)}
    return jsonschema.Draft202012Validator(schema)


@cache
def _cert_manager_validator(kind: str, version: str) -> jsonschema.Draft202012Validator:
    schema = strict_schema(kind)
    jsonschema.Draft202012Validator.check_schema(schema)  # before the (large, trusted) definitions
    return jsonschema.Draft202012Validator({**schema, "$defs": {**_definitions(version), **schema["$defs"]}})


def _where(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top level)"


def errors(doc: dict[str, Any], version: str = K8S_VERSION) -> list[str]:
    """Every schema violation of one manifest on Kubernetes ``version``, as "Kind name: path: message";
    [] if valid.

    A kind with no schema here (neither core Kubernetes nor a cert-manager kind) is itself an error.
    """
    kind = doc.get("kind", "?")
    name = (doc.get("metadata") or {}).get("name", "?")
    api_version = str(doc.get("apiVersion", ""))
    if api_version == "cert-manager.io/v1":
        if kind not in CERT_MANAGER_KINDS:
            return [f"{kind} {name}: no cert-manager schema for this kind here (only {CERT_MANAGER_KINDS})"]
        validator = _cert_manager_validator(kind, version)
    else:
        found = _core_validator(version, api_version, kind)
        if found is None:
            return [f"{kind} {name}: no Kubernetes {version} schema for {api_version} {kind}"]
        validator = found
    return [
        f"{kind} {name}: {_where(e)}: {e.message}"
        + (f" ({e.schema['$comment']})" if isinstance(e.schema, dict) and "$comment" in e.schema else "")
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]
