"""Load YAML a user wrote (job specs, credential files) without letting bad input crash or hang us.

Why not plain ``yaml.safe_load``: it is safe against code execution, but not against input that is
merely hostile or broken. A file of random bytes raises ``UnicodeDecodeError`` (a traceback, not a
message); ``a: &a [*a]`` builds a cyclic object that later blows the stack; nine nested aliases
("billion laughs") expand to 10^9 nodes when the data is walked; 10 000 nested brackets exhaust
PyYAML's recursion; and a duplicated key silently keeps the last value. Every one of those becomes a
:class:`YamlInputError` here, naming the file (``origin``) and, where YAML knows it, the line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MAX_BYTES = 1 << 20  # a job spec is a page of YAML; a megabyte is someone's mistake
MAX_DEPTH = 64  # nesting of lists/maps
MAX_ALIASES = 256  # `*name` references in one document
MAX_NODES = 100_000  # values after expanding every alias


class YamlInputError(ValueError):
    """YAML input that cannot be used; the message names the origin and what is wrong with it."""


class _GuardedLoader(yaml.SafeLoader):
    """SafeLoader that refuses alias cycles, too many aliases, deep nesting and duplicate keys."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._open_anchors: set[str] = set()
        self._aliases = 0
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open_anchors:
                raise YamlInputError(
                    f"line {event.start_mark.line + 1}: alias *{event.anchor} refers to a node that "
                    "contains it (a cycle)"
                )
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise YamlInputError(
                    f"line {event.start_mark.line + 1}: more than {MAX_ALIASES} aliases (*name)"
                )
            return super().compose_node(parent, index)
        anchor = getattr(event, "anchor", None)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise YamlInputError(f"line {event.start_mark.line + 1}: nested deeper than {MAX_DEPTH} levels")
        if anchor is not None:
            self._open_anchors.add(anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1
            if anchor is not None:
                self._open_anchors.discard(anchor)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:
                raise YamlInputError(
                    f"line {key_node.start_mark.line + 1}: a mapping key must be a plain value, "
                    f"got a {type(key).__name__}"
                ) from None
            if duplicate:
                raise YamlInputError(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}")
        return super().construct_mapping(node, deep=deep)


def _count_nodes(data: Any, origin: str) -> None:
    """Walk the loaded data as a consumer would, refusing alias expansion past MAX_NODES values."""
    budget = MAX_NODES
    stack = [data]
    while stack:
        item = stack.pop()
        budget -= 1
        if budget < 0:
            raise YamlInputError(
                f"{origin}: more than {MAX_NODES} values once aliases are expanded (an alias bomb?)"
            )
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set):
            stack.extend(item)


def decode_text(raw: bytes, origin: str) -> str:
    """UTF-8 text of ``raw`` (a BOM allowed), or an error saying which encoding it seems to be in."""
    if raw.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")):
        raise YamlInputError(f"{origin}: the file is UTF-32 encoded; save it as UTF-8")
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise YamlInputError(f"{origin}: the file is UTF-16 encoded; save it as UTF-8")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise YamlInputError(
            f"{origin}: not UTF-8 text: byte 0x{raw[exc.start]:02x} at offset {exc.start} "
            "(binary data, or another encoding such as Latin-1; save it as UTF-8)"
        ) from None
    if "\x00" in text:
        raise YamlInputError(f"{origin}: not text: NUL byte at offset {text.index(chr(0))}")
    return text


def load_yaml_text(text: str, origin: str) -> Any:
    """Parse one YAML document from ``text`` with the guards above."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise YamlInputError(f"{origin}: larger than {MAX_BYTES} bytes")
    loader: _GuardedLoader | None = None
    try:
        loader = _GuardedLoader(text)  # its reader already refuses control characters
        data = loader.get_single_data()
    except YamlInputError as exc:
        raise YamlInputError(f"{origin}: {exc}") from None
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).replace('in "<unicode string>", ', "at ").split())
        raise YamlInputError(f"{origin}: not valid YAML: {detail}") from None
    except RecursionError:
        raise YamlInputError(f"{origin}: nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()
    _count_nodes(data, origin)
    return data


def load_yaml_file(path: Path, origin: str | None = None) -> Any:
    """Read and parse a YAML file; every failure (missing, unreadable, binary, malformed) is a message."""
    origin = origin or str(path)
    try:
        if path.stat().st_size > MAX_BYTES:
            raise YamlInputError(f"{origin}: larger than {MAX_BYTES} bytes")
        raw = path.read_bytes()
    except OSError as exc:
        raise YamlInputError(f"{origin}: cannot read: {exc.strerror or exc}") from None
    return load_yaml_text(decode_text(raw, origin), origin)
