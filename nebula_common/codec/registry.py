"""Codec spec strings and the open registry that turns them into codecs.

A spec is a small expression, ``name`` or ``name(arg, ..., key=value, ...)``, where a
positional argument is a number or another spec and a keyword argument's value is a
number or a bare word: ``fp16``, ``topk(0.01)``, ``fp16(svd(0.6))``,
``int8(scale=block,block=64)``. It travels
in every tensor header, so the parser is strict (a spec must mean exactly one
thing), bounded (headers come from the network) and canonicalising (``" FP16 "``
and ``"fp16"`` name the same codec and produce the same header).

Codecs register a factory under a name. The factory is called with the parsed
arguments: numbers as ``int``/``float`` and nested specs already resolved to
``Codec`` instances, keyword arguments as Python keyword arguments. Arity is
checked against the factory's signature before the call, so a codec that takes
no arguments rejects ``none(0.5)`` with a clear error instead of silently
ignoring the argument, and an unknown option is named.
"""

from __future__ import annotations

import inspect
import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from nebula_common.codec.base import Codec, CodecError

CodecFactory = Callable[..., Codec]

MAX_SPEC_LENGTH = 256
"""Longest spec accepted; specs arrive in headers from the other cluster."""

MAX_SPEC_DEPTH = 8
"""Deepest nesting accepted, which also bounds the parser's recursion."""

_NAME_RE = re.compile(r"[a-z_][a-z0-9_]*")
_NUMBER_RE = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?")

_registry: dict[str, CodecFactory] = {}
_registry_lock = threading.Lock()


KwargValue = int | float | str
"""A keyword argument's value: a number or a bare lower-case word (``scale=row``)."""


@dataclass(frozen=True)
class SpecNode:
    """One parsed ``name(args..., key=value...)`` term; ``str()`` gives the canonical spelling.

    Keyword arguments are kept sorted by key, so ``int8(block=64,scale=block)`` and
    ``int8(scale=block, block=64)`` are one spec with one header string.
    """

    name: str
    args: tuple[int | float | SpecNode, ...] = ()
    kwargs: tuple[tuple[str, KwargValue], ...] = ()

    def __str__(self) -> str:
        if not self.args and not self.kwargs:
            return self.name
        parts = [_format_arg(arg) for arg in self.args]
        parts += [f"{key}={_format_arg(value)}" for key, value in self.kwargs]
        return f"{self.name}({','.join(parts)})"


def _format_arg(arg: int | float | str | SpecNode) -> str:
    # repr() of a float is the shortest string that round-trips, so canonical
    # specs re-parse to the identical tree.
    return repr(arg) if isinstance(arg, float) else str(arg)


def format_spec(name: str, *args: int | float | str, **kwargs: KwargValue | None) -> str:
    """Canonical spelling of ``name(args..., key=value...)``, dropping keyword values that are None.

    Codec classes use this to build their ``spec`` so it always matches what the
    parser produces for the same arguments (including the sorted keyword order).
    """
    positional = tuple(parse_spec(arg) if isinstance(arg, str) else arg for arg in args)
    keywords = tuple(sorted((k, v) for k, v in kwargs.items() if v is not None))
    return str(SpecNode(name, positional, keywords))


class _Parser:
    """Recursive-descent parser over a lower-cased spec: spec := NAME [ '(' [arg {',' arg}] ')' ]."""

    def __init__(self, text: str, original: str) -> None:
        self.text = text
        self.original = original
        self.pos = 0

    def error(self, what: str) -> CodecError:
        return CodecError(f"invalid codec spec {self.original!r}: {what} at position {self.pos}")

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def parse(self) -> SpecNode:
        node = self.spec(depth=1)
        self.skip_space()
        if self.pos != len(self.text):
            raise self.error(f"unexpected {self.text[self.pos]!r}")
        return node

    def spec(self, depth: int) -> SpecNode:
        if depth > MAX_SPEC_DEPTH:
            raise self.error(f"nesting deeper than {MAX_SPEC_DEPTH}")
        self.skip_space()
        match = _NAME_RE.match(self.text, self.pos)
        if match is None:
            found = repr(self.text[self.pos]) if self.pos < len(self.text) else "end of spec"
            raise self.error(f"expected a codec name, found {found}")
        self.pos = match.end()
        name = match.group()
        self.skip_space()
        if self.pos >= len(self.text) or self.text[self.pos] != "(":
            return SpecNode(name)
        self.pos += 1
        args: list[int | float | SpecNode] = []
        kwargs: dict[str, KwargValue] = {}
        self.skip_space()
        if self.pos < len(self.text) and self.text[self.pos] == ")":
            # "fp16()" would be a second spelling of "fp16"; a spec must have exactly one.
            raise self.error(f"empty argument list; write {name!r} without parentheses")
        while True:
            keyword = self.keyword()
            if keyword is not None:
                if keyword in kwargs:
                    raise self.error(f"keyword {keyword!r} given twice to {name}")
                kwargs[keyword] = self.kwarg_value(keyword)
            elif kwargs:
                raise self.error(f"positional argument after keyword arguments of {name}")
            else:
                args.append(self.arg(depth))
            self.skip_space()
            if self.pos >= len(self.text):
                raise self.error(f"missing ')' after arguments of {name}")
            if self.text[self.pos] == ",":
                self.pos += 1
                continue
            if self.text[self.pos] == ")":
                self.pos += 1
                return SpecNode(name, tuple(args), tuple(sorted(kwargs.items())))
            raise self.error(f"expected ',' or ')' in arguments of {name}, found {self.text[self.pos]!r}")

    def keyword(self) -> str | None:
        """Consume ``NAME =`` and return NAME if the next argument is a keyword argument."""
        self.skip_space()
        match = _NAME_RE.match(self.text, self.pos)
        if match is None:
            return None
        after = match.end()
        while after < len(self.text) and self.text[after].isspace():
            after += 1
        if after >= len(self.text) or self.text[after] != "=":
            return None
        self.pos = after + 1
        return match.group()

    def kwarg_value(self, keyword: str) -> KwargValue:
        self.skip_space()
        if _NUMBER_RE.match(self.text, self.pos) is not None:
            return self.number()
        match = _NAME_RE.match(self.text, self.pos)
        if match is None:
            raise self.error(f"keyword {keyword!r} needs a number or a word")
        self.pos = match.end()
        return match.group()

    def arg(self, depth: int) -> int | float | SpecNode:
        self.skip_space()
        if _NUMBER_RE.match(self.text, self.pos) is None:
            return self.spec(depth + 1)
        return self.number()

    def number(self) -> int | float:
        match = _NUMBER_RE.match(self.text, self.pos)
        if match is None:
            raise self.error("expected a number")
        literal = match.group()
        self.pos = match.end()
        if "." not in literal and "e" not in literal:
            return int(literal)
        value = float(literal)
        if not math.isfinite(value):
            raise self.error(f"number {literal} is out of range")
        return value


def parse_spec(spec: str) -> SpecNode:
    """Parse a spec (case-insensitive, whitespace-tolerant) into a tree, without resolving names."""
    if not isinstance(spec, str):
        raise CodecError(f"codec spec must be a string, got {type(spec).__name__}")
    if len(spec) > MAX_SPEC_LENGTH:
        raise CodecError(f"codec spec is {len(spec)} characters, longer than the {MAX_SPEC_LENGTH} allowed")
    if not spec.strip():
        raise CodecError(f"empty codec spec; known codecs: {', '.join(available_codecs())}")
    return _Parser(spec.lower(), spec).parse()


def register_codec(name: str, factory: CodecFactory, *, replace: bool = False) -> None:
    """Make ``factory`` available under ``name`` (lower-case identifier).

    Registering a taken name is an error unless ``replace`` is set, so two plug-ins
    cannot silently shadow each other.
    """
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None:
        raise CodecError(f"codec name {name!r} must be a lower-case identifier ([a-z_][a-z0-9_]*)")
    if not callable(factory):
        raise CodecError(f"factory for codec {name!r} is not callable")
    with _registry_lock:
        if name in _registry and not replace:
            raise CodecError(f"codec {name!r} is already registered")
        _registry[name] = factory
        _build.cache_clear()


def available_codecs() -> list[str]:
    """Registered codec names, sorted."""
    with _registry_lock:
        return sorted(_registry)


def get_codec(spec: str) -> Codec:
    """Parse ``spec`` and return the codec it names (cached: codecs are stateless)."""
    return _build(str(parse_spec(spec)))


@lru_cache(maxsize=256)
def _build(canonical: str) -> Codec:
    # Keyed by the canonical string rather than the tree: SpecNode(args=(1,)) and
    # SpecNode(args=(1.0,)) compare equal but are different specs.
    node = parse_spec(canonical)
    with _registry_lock:
        factory = _registry.get(node.name)
    if factory is None:
        raise CodecError(f"unknown codec {node.name!r}; known codecs: {', '.join(available_codecs())}")
    # Arity first, so "fp16(svd(0.6))" says fp16 takes no arguments rather than complaining about svd.
    _check_arity(node, factory)
    args = [_build(str(arg)) if isinstance(arg, SpecNode) else arg for arg in node.args]
    codec = factory(*args, **dict(node.kwargs))
    if not isinstance(codec, Codec):
        raise CodecError(f"factory for codec {node.name!r} returned {type(codec).__name__}, not a Codec")
    if codec.spec != str(node):
        # A codec may shorten its spec (drop default keywords: "int8(scale=tensor)" is
        # "int8"), but the header carries codec.spec, so it must re-parse to a codec
        # with that very spec; otherwise the receiver would decode with something
        # other than what the sender used.
        reported = _reparse(codec.spec)
        if reported is None or reported.name != node.name or _build(codec.spec).spec != codec.spec:
            raise CodecError(
                f"codec {node.name!r} reports spec {codec.spec!r} but was built from {str(node)!r}"
            )
    return codec


def _reparse(spec: object) -> SpecNode | None:
    try:
        return parse_spec(spec)  # type: ignore[arg-type]
    except CodecError:
        return None


def _check_arity(node: SpecNode, factory: CodecFactory) -> None:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # Builtins without a signature validate their own arguments.
    try:
        signature.bind(*node.args, **dict(node.kwargs))
    except TypeError:
        params = [p.name for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
        if not params:
            raise CodecError(f"{node.name} takes no arguments, got {str(node)!r}") from None
        unknown = [key for key, _ in node.kwargs if key not in params]
        if unknown:
            raise CodecError(
                f"{node.name} has no option {unknown[0]!r} (options: {', '.join(params)}) in {str(node)!r}"
            ) from None
        raise CodecError(
            f"{node.name} takes arguments ({', '.join(params)}), got {len(node.args)} in {str(node)!r}"
        ) from None


def parse_direction_pair(text: str) -> tuple[str, str]:
    """Split the paper's ``FWD+BWD`` notation ("FP16+INT8") into canonical forward/backward specs.

    A single spec without ``+`` applies to both directions. Both halves are resolved
    so a typo fails here, at configuration time, rather than mid-training.
    """
    if not isinstance(text, str):
        raise CodecError(f"codec pair must be a string, got {type(text).__name__}")
    parts = text.split("+")
    if len(parts) == 1:
        spec = get_codec(parts[0]).spec
        return spec, spec
    if len(parts) != 2:
        raise CodecError(f"codec pair {text!r} must be 'FORWARD+BACKWARD', e.g. 'FP16+INT8'")
    forward, backward = parts
    try:
        forward_spec = get_codec(forward).spec
    except CodecError as exc:
        raise CodecError(f"forward codec of {text!r}: {exc}") from None
    try:
        backward_spec = get_codec(backward).spec
    except CodecError as exc:
        raise CodecError(f"backward codec of {text!r}: {exc}") from None
    return forward_spec, backward_spec
