"""Pre-trained weights from disk: Hugging Face-format directories, checked before a stage starts.

A team's pre-trained model is a folder written by ``save_pretrained``: ``config.json`` plus
``model.safetensors`` (or ``model.safetensors.index.json`` and its shards). Nebula never goes to a
hub: ``HF_HUB_OFFLINE`` is set before ``transformers`` is imported and every load is
``local_files_only``.

A stage module says which of its options name such folders, as a literal at its top level::

    PRETRAINED_DIRS = {
        "encoder_dir": {"class": "AutoModel", "hidden_size": "== d_model", "vocab_size": ">= vocab_size"},
    }

(each other key is a config attribute that must be ``==`` or ``>=`` an option of the stage). Why a
declaration and not a convention: the submitter resolves those options against the spec's folder,
and the trainer checks each folder (it exists, has a config and weights, the weights' names and
shapes are the ones the config's model has, the config agrees with the options) in its validation
path, reading only ``config.json`` and the safetensors headers. So a missing or mismatched
checkpoint is a spec error naming the option and the path, before a runner exists, not a stack
trace once both clusters are training.
"""

from __future__ import annotations

import ast
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nebula_common import pysource

if TYPE_CHECKING:  # torch only where a model is loaded: checking a job spec must stay light
    from torch import nn

DECLARATION = "PRETRAINED_DIRS"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
CLASSES = ("AutoModel", "AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForSeq2SeqLM")
_OPS = ("==", ">=")


class PretrainedError(ValueError):
    """A pre-trained directory (or a module's declaration of one) is unusable; the message names it."""


def _offline() -> None:
    # Before transformers/huggingface_hub read it (at import): no network, whatever a model asks for.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def declared_dirs(source: str, filename: str = "<stage>") -> dict[str, dict[str, str]]:
    """A module's ``PRETRAINED_DIRS`` (read with ``ast``, never executed); {} when it declares none."""
    try:
        tree = pysource.parse(source, filename=filename)
    except (SyntaxError, ValueError, RecursionError):
        return {}  # the module checks report the syntax error
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == DECLARATION for t in node.targets
        ):
            try:
                value = ast.literal_eval(node.value)
            except (ValueError, SyntaxError) as exc:
                raise PretrainedError(f"{filename}: {DECLARATION} must be a literal dict: {exc}") from None
            return _check_declaration(value, filename)
    return {}


def _check_declaration(value: Any, filename: str) -> dict[str, dict[str, str]]:
    where = f"{filename}: {DECLARATION}"
    if not isinstance(value, dict):
        raise PretrainedError(f"{where} must map option names to requirements, got {type(value).__name__}")
    for option, rules in value.items():
        if not isinstance(option, str) or not isinstance(rules, dict):
            raise PretrainedError(f"{where}: {option!r} must map to a dict of requirements")
        if rules.get("class", "AutoModel") not in CLASSES:
            raise PretrainedError(f"{where}.{option}.class must be one of {', '.join(CLASSES)}")
        for attribute, rule in rules.items():
            if attribute != "class" and (not isinstance(rule, str) or rule[:2] not in _OPS):
                raise PretrainedError(
                    f"{where}.{option}.{attribute}: {rule!r} is not '== OPTION' or '>= OPTION'"
                )
    return value


def resolve_dirs(
    options: dict[str, Any], declared: dict[str, dict[str, str]], base_dir: Path
) -> dict[str, Any]:
    """``options`` with each declared, non-empty directory made absolute against ``base_dir`` (the spec's)."""
    resolved = dict(options)
    for option in declared:
        value = options.get(option)
        if isinstance(value, str) and value:
            resolved[option] = str((base_dir / Path(value).expanduser()).resolve())
    return resolved


def dir_problems(options: dict[str, Any], declared: dict[str, dict[str, str]], field: str) -> list[str]:
    """Every problem of every declared directory option, each starting with ``{field}.{option}``.

    An option that is absent or empty means "no pre-trained weights" and is not checked.
    """
    problems: list[str] = []
    for option, rules in declared.items():
        value = options.get(option)
        if value in (None, ""):
            continue
        where = f"{field}.{option}"
        if not isinstance(value, str):
            problems.append(f"{where}: must be a directory path, got {type(value).__name__}")
            continue
        problems += [f"{where}: {value}: {p}" for p in check_dir(Path(value), rules, options)]
    return problems


def check_dir(path: Path, rules: dict[str, str], options: dict[str, Any]) -> list[str]:
    """What is wrong with one Hugging Face-format directory for these rules (empty: nothing)."""
    if not path.is_absolute():
        return [
            "must be an absolute path in this cluster (the submitter resolves paths relative to the spec)"
        ]
    if not path.is_dir():
        return ["is a file, not a directory" if path.exists() else "no such directory"]
    config_path = path / CONFIG
    if not config_path.is_file():
        return [f"no {CONFIG} (a Hugging Face-format directory, as written by save_pretrained)"]
    try:
        config_data = json.loads(config_path.read_text())
        if not isinstance(config_data, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        return [f"{CONFIG} is not readable JSON: {exc}"]
    _offline()
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        return [f"reading it needs transformers and safetensors (the text extra) in this cluster: {exc}"]
    try:
        shapes = weight_shapes(path)
    except PretrainedError as exc:
        return [str(exc)]
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        return [f"{CONFIG}: {exc}"]
    problems = _rule_problems(config, rules, options)
    expected = _expected_shapes(config, rules.get("class", "AutoModel"))
    if isinstance(expected, str):
        return [*problems, expected]
    return problems + _shape_problems(expected, shapes, getattr(config, "model_type", "?"))


def weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a directory's safetensors weights, from the file headers only."""
    from safetensors import safe_open

    single, index = path / WEIGHTS, path / WEIGHTS_INDEX
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({path / name for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise PretrainedError(f"{WEIGHTS_INDEX} is not a valid index: {exc}") from None
    else:
        raise PretrainedError(f"no {WEIGHTS} (nor {WEIGHTS_INDEX}): weights must be safetensors")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        if file.exists() and not os.access(file, os.R_OK):  # safetensors would call it missing
            raise PretrainedError(f"{file.name} is not readable by this process's user (uid {os.getuid()})")
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        except Exception as exc:  # safetensors raises its own error types for a corrupt header
            raise PretrainedError(f"{file.name} is not a readable safetensors file: {exc}") from None
    return shapes


def _rule_problems(config: Any, rules: dict[str, str], options: dict[str, Any]) -> list[str]:
    problems = []
    for attribute, rule in rules.items():
        if attribute == "class":
            continue
        op, option = rule[:2], rule[2:].strip()
        have, want = getattr(config, attribute, None), options.get(option)
        if not isinstance(have, int) or not isinstance(want, int):
            problems.append(f"{CONFIG} {attribute}={have!r} cannot be compared with option {option}={want!r}")
        elif (op == "==" and have != want) or (op == ">=" and have < want):
            problems.append(
                f"{CONFIG} has {attribute}={have}, the stage's option {option} is {want} (needs {op})"
            )
    return problems


def _expected_shapes(config: Any, class_name: str) -> dict[str, tuple[int, ...]] | str:
    """Parameter name -> shape of the model the config builds, on the meta device (no memory)."""
    import torch
    import transformers

    try:
        with torch.device("meta"):
            model = getattr(transformers, class_name).from_config(config)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{CONFIG}: cannot build a {class_name} from it: {exc}"
    prefix = getattr(model, "base_model_prefix", "") or ""
    return {"prefix": prefix, **{n: tuple(p.shape) for n, p in model.named_parameters()}}  # type: ignore[dict-item]


def _shape_problems(
    expected: dict[str, Any], saved: dict[str, tuple[int, ...]], model_type: str
) -> list[str]:
    """Missing or mis-shaped weights; names may differ by the base model's prefix (as transformers allows)."""
    prefix = expected.pop("prefix")

    def find(name: str) -> str | None:
        candidates = [name, f"{prefix}.{name}", name.removeprefix(f"{prefix}.")] if prefix else [name]
        return next((c for c in candidates if c in saved), None)

    missing, mismatched = [], []
    for name, shape in expected.items():
        key = find(name)
        if key is None:
            missing.append(name)
        elif saved[key] != shape:
            mismatched.append(
                f"{key} is {list(saved[key])}, the config's {model_type} model needs {list(shape)}"
            )
    problems = []
    if mismatched:
        problems.append(f"weights do not match {CONFIG}: " + "; ".join(mismatched[:3]))
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        problems.append(f"weights lack {', '.join(missing[:3])}{more} of the config's {model_type} model")
    return problems


def load_dir(path: str, class_name: str = "AutoModel") -> nn.Module:
    """The model of a checked directory, offline, with dropout off (a frozen model runs deterministically)."""
    if class_name not in CLASSES:
        raise PretrainedError(f"class {class_name!r} must be one of {', '.join(CLASSES)}")
    _offline()
    import transformers

    transformers.utils.logging.disable_progress_bar()
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    no_dropout = {
        key: 0.0
        for key, value in config.to_dict().items()
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key) and math.isfinite(value)
    }
    try:
        model = getattr(transformers, class_name).from_pretrained(path, local_files_only=True, **no_dropout)
    except (OSError, ValueError, RuntimeError) as exc:
        raise PretrainedError(f"{path}: cannot load as {class_name}: {exc}") from None
    from torch import nn

    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def transformer_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of transformer blocks (``encoder.layer``, ``transformer.h``, ``model.layers``...)."""
    from torch import nn

    count = getattr(model.config, "num_hidden_layers", None)
    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return module
    raise PretrainedError(f"found no list of {count} transformer layers in a {type(model).__name__}")
