"""Loading a job spec: YAML (a file, text or a mapping) with overrides, then its stage modules.

The model (``spec.py``) says what a valid spec is; this reads one from what a user hands over and
checks the stage modules it names (read and compiled, never run), with every problem a
:class:`~nebula_common.jobspec.spec.SpecError` that names the file or field.
"""

from __future__ import annotations

import ast
import copy
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from nebula_common import pysource
from nebula_common.jobspec.spec import (
    MAX_MODULE_BYTES,
    JobSpec,
    SpecError,
    StageDecl,
    required_functions,
    stage_role,
)
from nebula_common.pretrained import PretrainedError, declared_dirs, dir_problems, resolve_dirs
from nebula_common.safe_yaml import YamlInputError, decode_text, load_yaml_file, load_yaml_text


@dataclass(frozen=True)
class StageModule:
    """One stage's module as it will be shipped: only to the cluster that runs the stage."""

    path: Path
    source: str


@dataclass(frozen=True)
class LoadedJob:
    spec: JobSpec
    modules: dict[str, StageModule]
    spec_path: Path | None = None

    def job_id(self) -> str:
        return f"{self.spec.name}-{uuid.uuid4().hex[:8]}"


def _format_validation(error: ValidationError, origin: str) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        if not item["loc"] and re.match(r"[a-z_]+(\.\w+)*: ", message):
            lines.append(f"{origin}: {message}")  # a whole-spec check that names its own field
        else:
            lines.append(f"{origin}: {where}: {message}")
    return "\n".join(lines)


def _check_module(
    stage: StageDecl, index: int, path: Path, origin: str, mode: str, stages: int = 2
) -> StageModule:
    field = f"stages.{index}.module"
    if not path.is_file():
        if path.is_dir():
            raise SpecError(f"{origin}: {field}: {path} is a directory, not a Python file")
        raise SpecError(f"{origin}: {field}: no such file {path}")
    try:
        if path.stat().st_size > MAX_MODULE_BYTES:
            raise SpecError(f"{origin}: {field}: {path} is larger than {MAX_MODULE_BYTES} bytes")
        source = decode_text(path.read_bytes(), str(path))
    except OSError as exc:
        raise SpecError(f"{origin}: {field}: cannot read {path}: {exc.strerror or exc}") from None
    except YamlInputError as exc:
        raise SpecError(f"{origin}: {field}: {exc}") from None
    try:
        tree = pysource.parse(source, filename=str(path))
    except SyntaxError as exc:
        raise SpecError(f"{origin}: {field}: {path}:{exc.lineno}: syntax error: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise SpecError(f"{origin}: {field}: {path}: not parseable Python: {exc}") from None
    defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
    defined |= {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    role = stage_role(index, stages)
    required = required_functions(role, mode)
    missing = [name for name in required if name not in defined]
    if missing:
        role = {
            "downstream": "downstream (loss-owning)",
            "upstream": f"upstream ({mode} pipeline)",
            "middle": "middle (chain)",
        }[role]
        raise SpecError(
            f"{origin}: {field}: {path} must define {', '.join(missing)} "
            f"(a {role} stage defines {', '.join(required)})"
        )
    return StageModule(path=path, source=source)


def parse_spec(data: Any, *, base_dir: Path, origin: str = "spec") -> LoadedJob:
    """Validate spec data (already parsed YAML) and read the stage modules it names."""
    if not isinstance(data, dict):
        raise SpecError(f"{origin}: the spec must be a mapping at the top level, got {type(data).__name__}")
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_format_validation(exc, origin)) from None
    modules = {
        stage.name: _check_module(
            stage, i, (base_dir / stage.module).resolve(), origin, spec.pipeline.mode, len(spec.stages)
        )
        for i, stage in enumerate(spec.stages)
    }
    return LoadedJob(spec=_pretrained_dirs(spec, modules, base_dir, origin), modules=modules)


def _pretrained_dirs(spec: JobSpec, modules: dict[str, StageModule], base_dir: Path, origin: str) -> JobSpec:
    """Resolve the pre-trained directories a module declares against the spec's folder, and check them.

    A relative path is on the submitter's machine, so it is checked here; an absolute one names a
    directory in the stage's cluster, checked by that cluster's trainer before the stage starts.
    """
    stages = []
    for index, stage in enumerate(spec.stages):
        module = modules[stage.name]
        try:
            declared = declared_dirs(module.source, str(module.path))
        except PretrainedError as exc:
            raise SpecError(f"{origin}: stages.{index}.module: {exc}") from None
        local = {
            name: rules
            for name, rules in declared.items()
            if isinstance(stage.options.get(name), str) and not Path(stage.options[name]).is_absolute()
        }
        options = resolve_dirs(stage.options, declared, base_dir)
        problems = dir_problems(options, local, f"stages.{index}.options")
        if problems:
            raise SpecError("\n".join(f"{origin}: {problem}" for problem in problems))
        stages.append(stage.model_copy(update={"options": options}))
    return spec.model_copy(update={"stages": stages})


SpecSource = Path | str | Mapping[str, Any]


def load_spec(
    source: SpecSource, overrides: dict[str, Any] | None = None, *, base_dir: Path | None = None
) -> LoadedJob:
    """Load a job spec from a file, YAML text or a dict; ``overrides`` (dotted keys) win over it.

    ``source`` is a :class:`Path` of a YAML file (stage modules are relative to its folder); a ``str``
    that is YAML text of a mapping (it is a path if it is one line that is not a mapping); or a mapping
    as the YAML would load. For text and mappings, modules are relative to ``base_dir`` (default: the
    current directory). Every problem is a :class:`SpecError` naming the file or field; never a
    traceback, whatever the bytes.
    """
    path: Path | None = None
    if isinstance(source, Mapping):
        origin = "spec"
        try:
            data: Any = copy.deepcopy(dict(source))
        except (TypeError, ValueError, RecursionError) as exc:
            raise SpecError(f"{origin}: cannot copy the spec data: {exc}") from None
    elif isinstance(source, Path) or (isinstance(source, str) and not _is_spec_text(source)):
        path = Path(source)
        origin = str(path)
        try:
            data = load_yaml_file(path)
        except YamlInputError as exc:
            raise SpecError(str(exc)) from None
    elif isinstance(source, str):
        origin = "spec"
        try:
            data = load_yaml_text(source, origin)
        except YamlInputError as exc:
            raise SpecError(str(exc)) from None
    else:
        raise SpecError(f"a spec is a Path, YAML text or a dict, not a {type(source).__name__}")
    if data is None:
        raise SpecError(f"{origin}: the spec is empty")
    if isinstance(data, dict):
        for dotted, value in (overrides or {}).items():
            set_dotted(data, dotted, value, origin)
    folder = path.resolve().parent if path is not None else (base_dir or Path.cwd())
    loaded = parse_spec(data, base_dir=folder, origin=origin)
    return LoadedJob(spec=loaded.spec, modules=loaded.modules, spec_path=path)


def _is_spec_text(text: str) -> bool:
    """A multi-line string, or a one-line YAML mapping (``{name: x, ...}``), is spec text."""
    if "\n" in text.strip():
        return True
    try:
        return isinstance(load_yaml_text(text, "spec"), dict)
    except YamlInputError:
        return False


def set_dotted(data: dict[str, Any], dotted: str, value: Any, origin: str) -> None:
    parts = dotted.split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        key: Any = int(part) if re.fullmatch(r"\d+", part) and isinstance(node, list) else part
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            if isinstance(node, dict):
                node = node.setdefault(part, {})
            else:
                raise SpecError(f"{origin}: override {dotted}: no {'.'.join(parts[: i + 1])}") from None
    last = parts[-1]
    if isinstance(node, list) and re.fullmatch(r"\d+", last):
        if int(last) >= len(node):
            raise SpecError(f"{origin}: override {dotted}: index {last} past the end ({len(node)} items)")
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise SpecError(f"{origin}: override {dotted}: cannot set inside a {type(node).__name__}")
