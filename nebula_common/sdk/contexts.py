"""Who the CLI acts as, remembered: one identity per deployment, kept by ``nebula login`` (kubeconfig style).

A context names a deployment (its run directory, or the directory of its ``deployment.json`` or endpoints
file) and the account to act as in each of its clusters. The current context is what ``nebula job``
commands use when they are given no ``--deployment`` or no ``--credentials``; ``job submit`` never creates
an account by itself any more (``--new-account`` asks for one through the admins).

The file is JSON, ``$NEBULA_CONTEXTS`` or ``$XDG_CONFIG_HOME/nebula/contexts.json`` (default
``~/.config/nebula/contexts.json``), 0600 in a 0700 directory, written atomically: it holds passwords,
as ``credentials/NAME.yaml`` and kubeconfig files do. A damaged file is named in the error, never
overwritten by a read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nebula_common.durable import atomic_write
from nebula_common.sdk.deployment import Credentials, DeploymentFileError, read_credentials

FORMAT = 1


def contexts_path() -> Path:
    """Where the contexts live (see the module doc)."""
    if os.environ.get("NEBULA_CONTEXTS"):
        return Path(os.environ["NEBULA_CONTEXTS"])
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "nebula" / "contexts.json"


def deployment_key(deployment: Path) -> str:
    """One deployment however it is named: its run directory, its ``deployment.json`` or its endpoints
    file all give the directory that holds them."""
    path = Path(deployment).expanduser().resolve()
    return str(path if path.is_dir() else path.parent)


@dataclass(frozen=True)
class Context:
    name: str
    deployment: str
    credentials: Credentials

    def to_json(self, current: bool = False) -> dict[str, Any]:
        """What ``nebula context list`` shows: never a password."""
        users = {cluster: entry["username"] for cluster, entry in sorted(self.credentials.items())}
        return {"name": self.name, "deployment": self.deployment, "accounts": users, "current": current}


class ContextStore:
    """The contexts file: read on every call (another shell may have logged in meanwhile)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or contexts_path()

    def _read(self) -> dict[str, Any]:
        try:
            body = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {"format": FORMAT, "current": None, "contexts": {}}
        except (OSError, ValueError) as exc:
            raise DeploymentFileError(f"{self.path}: not a contexts file ({exc}); fix or remove it") from None
        if not isinstance(body, dict) or not isinstance(body.get("contexts"), dict):
            raise DeploymentFileError(f"{self.path}: not a contexts file (no 'contexts'); fix or remove it")
        return body

    def contexts(self) -> list[Context]:
        body = self._read()
        found = []
        for name, entry in sorted(body["contexts"].items()):
            if not isinstance(entry, dict) or not isinstance(entry.get("deployment"), str):
                raise DeploymentFileError(f"{self.path}: context {name!r} names no deployment")
            credentials = read_credentials(entry.get("credentials") or {}) or {}
            found.append(Context(name, entry["deployment"], credentials))
        return found

    def current_name(self) -> str | None:
        current = self._read().get("current")
        return current if isinstance(current, str) else None

    def current(self) -> Context | None:
        name = self.current_name()
        return next((c for c in self.contexts() if c.name == name), None)

    def get(self, name: str) -> Context:
        found = next((c for c in self.contexts() if c.name == name), None)
        if found is None:
            known = ", ".join(c.name for c in self.contexts()) or "none"
            raise DeploymentFileError(f"no context {name!r} (known: {known})")
        return found

    def save(self, context: Context, make_current: bool = True) -> None:
        body = self._read()
        body["format"] = FORMAT
        body["contexts"][context.name] = {
            "deployment": context.deployment,
            "credentials": context.credentials,
        }
        if make_current:
            body["current"] = context.name
        self._write(body)

    def use(self, name: str) -> Context:
        context = self.get(name)
        body = self._read()
        body["current"] = name
        self._write(body)
        return context

    def remove(self, name: str) -> Context:
        context = self.get(name)
        body = self._read()
        del body["contexts"][name]
        if body.get("current") == name:
            body["current"] = None
        self._write(body)
        return context

    def _write(self, body: dict[str, Any]) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write(self.path, (json.dumps(body, indent=2) + "\n").encode(), mode=0o600)


def resolve(deployment: Path | None, credentials: Path | None) -> tuple[Path, Path | Credentials | None, str]:
    """The deployment and identity a command acts on, and where they came from (for its messages).

    ``deployment`` None: the current context's; ``credentials`` None: the current context's when it is
    a context of this deployment, else None (the caller's default: the admins for viewing, an error
    for submitting).
    """
    current = ContextStore().current()
    if deployment is None:
        if current is None:
            raise DeploymentFileError(
                "no --deployment, and no current context: `nebula login --deployment DIR --username NAME` "
                "once, or give --deployment"
            )
        deployment = Path(current.deployment)
    if credentials is not None:
        return deployment, credentials, "--credentials"
    if current is not None and current.deployment == deployment_key(deployment):
        return deployment, current.credentials, f"context {current.name}"
    return deployment, None, ""


__all__ = ["Context", "ContextStore", "contexts_path", "deployment_key", "resolve"]
