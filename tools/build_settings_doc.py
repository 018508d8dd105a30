"""Build docs/settings.md: every service's environment settings, from the settings classes themselves.

Why generated: the services read about a hundred ``NEBULA_<SERVICE>_*`` variables through pydantic settings
classes whose fields carry their type, default, bounds and a description. A hand-kept list drifts from
them; this page cannot (``--check`` fails when it is stale; ``make test`` runs it).

    python tools/build_settings_doc.py           # rewrite docs/settings.md
    python tools/build_settings_doc.py --check   # fail if it is stale
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "docs" / "settings.md"

SERVICES = (
    ("auth", "services.auth.config", "AuthSettings", "accounts, passwords, token signing"),
    ("codec", "services.codec.config", "CodecSettings", "off-box tensor encode/decode"),
    ("data", "services.data.config", "DataSettings", "datasets and grants"),
    ("signer", "services.signer.config", "SignerSettings", "holds the audit seal keys"),
    ("switch", "services.switch.config", "SwitchSettings", "the gateway: WAN link, edges, certificates"),
    ("trainer", "services.trainer.config", "TrainerSettings", "runs this cluster's stages"),
)


CONSTANTS = (
    (
        "nebula_common.service.resources",
        "HANDSHAKE_TIMEOUT_S",
        "s: an internal port drops a connection that has not finished TLS and HTTP/2 set-up by then",
    ),
    (
        "nebula_common.service.resources",
        "MAX_CONNECTIONS",
        "connections an internal port holds at once",
    ),
    (
        "nebula_common.service.identity",
        "CERT_CHECK_INTERVAL_S",
        "s between re-reads of a service's certificate files and the cluster CRL",
    ),
    (
        "nebula_common.audit",
        "SEAL_INTERVAL_S",
        "s: the longest an audit record stays unsealed while events arrive",
    ),
    (
        "nebula_common.audit.log",
        "SEGMENT_BYTES",
        "bytes at which an audit log is sealed and rotated",
    ),
    (
        "nebula_common.audit.log",
        "SEGMENTS_KEPT",
        "rotated audit segments kept (with the current one: at most 576 MiB a log)",
    ),
    (
        "services.switch.server_tasks",
        "MAINTENANCE_INTERVAL_S",
        "s between the switch's checks of peer trust, CRLs and live edges' credentials",
    ),
    (
        "services.switch.server_tasks",
        "CERT_CHECK_INTERVAL_S",
        "s between the switch's checks of its own certificate",
    ),
    (
        "services.switch.server_wan",
        "LINK_WINDOW_BYTES",
        "bytes: fixed HTTP/2 window (raw link: send buffer) of a WAN link connection",
    ),
    (
        "services.switch.certs",
        "RENEW_BEFORE_FRACTION",
        "of a certificate's lifetime left when the switch renews it itself (development PKI)",
    ),
    (
        "services.switch.certs",
        "WARN_BEFORE_S",
        "s before expiry from which the switch logs a warning",
    ),
    (
        "services.switch.route_limits",
        "TOMBSTONE_S",
        "s items of a route the switch closed are dropped silently",
    ),
    (
        "services.trainer.edge.settings",
        "MAX_FRAME_BYTES",
        "bytes: largest tensor a peer may announce on an edge",
    ),
    (
        "services.trainer.servicer",
        "METRICS_GRACE_S",
        "s a finished stage's series stay on /metrics",
    ),
)
"""Values fixed on purpose (an operator has no reason to turn them), listed so that nobody looks for a
variable: module, attribute, what it bounds."""


def _type(annotation: Any) -> str:
    """A reader's name for a field's type: ``int``, ``Path or None``, ``one of 'a', 'b'``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(arg) for arg in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)} of {', '.join(_type(arg) for arg in args)}"
    return "None" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))


def _default(field: Any) -> str:
    if field.is_required():
        return "**required**"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    return f"`{text}`" if text else '`""`'


def _bounds(field: Any) -> str:
    parts = []
    for item in field.metadata:
        for name, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(item, name, None)
            if value is not None:
                parts.append(f"{symbol} {value}")
    return ", ".join(parts)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def service_table(service: str, module: str, cls_name: str) -> list[str]:
    settings = getattr(__import__(module, fromlist=[cls_name]), cls_name)
    prefix = str(settings.model_config.get("env_prefix", ""))
    lines = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for name, field in sorted(settings.model_fields.items()):
        bounds = _bounds(field)
        kind = _type(field.annotation) + (f" ({bounds})" if bounds else "")
        lines.append(
            f"| `{prefix}{name.upper()}` | {_cell(kind)} | {_cell(_default(field))} "
            f"| {_cell(field.description or '')} |"
        )
    return lines


def build() -> str:
    lines = [
        "# Service settings",
        "",
        "GENERATED by `python tools/build_settings_doc.py` from the services' settings classes: do not",
        "edit by hand. Each service reads only its own `NEBULA_<SERVICE>_*` variables; an unknown or",
        "malformed value stops it at start with a message naming the variable. `nebula local up`,",
        "`docker-compose.yml` and `k8s/` set the ones a deployment needs; the rest keep their defaults.",
        "A variable under a service's prefix that names no setting also stops it (a typo, or a value that",
        "is now fixed: see the last section).",
        "",
    ]
    for service, module, cls_name, what in SERVICES:
        lines += [f"## {service} ({what})", "", *service_table(service, module, cls_name), ""]
    lines += [
        "## Fixed values",
        "",
        "Not settings: the code's constants, tuned once and the same in every deployment.",
        "",
        "| constant | value | meaning |",
        "|---|---|---|",
    ]
    for module, attribute, meaning in CONSTANTS:
        value = getattr(__import__(module, fromlist=[attribute]), attribute)
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(f"| `{module}.{attribute}` | {shown} | {_cell(meaning)} |")
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    sys.path.insert(0, str(ROOT / "tools"))
    from _generated import write_or_check

    return write_or_check(OUT, build(), "python tools/build_settings_doc.py")


if __name__ == "__main__":
    sys.exit(main())
