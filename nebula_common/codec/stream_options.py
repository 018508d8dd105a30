"""Stream options (``ef``, ``delta``, ``start``, ``auto``): their spec values and the config they parse to.

A trainer owns one ``TensorStreamEncoder`` for each (edge, direction) it sends on
and one ``TensorStreamDecoder`` for each it receives on. Stateful techniques live
behind these two objects, so training code only ever says "send this tensor of
step s for these samples" and never touches codec state:

* **error feedback** (``ef(spec)``): the sender keeps what compression dropped
  (``x - decode(encode(x))``) and adds it to the next tensor of the same shape
  on this stream, so the error does not accumulate over steps (gradient codecs);
* **delta** (``delta(spec)``, ``delta(spec,cache=N)``): AQ-SGD-style activation
  compression. Both ends keep a per-sample cache of the last reconstructed row
  (dim 0 of the tensor is the sample); the sender encodes ``x - cache[ids]`` and
  both ends add the decoded difference to the cache. The header carries the
  CRC-32 of the base the sender used and the receiver refuses the frame if its
  own cache differs, so diverged caches fail loudly. The cache is an LRU of at
  most ``cache`` samples, updated identically on both ends;
* **warm-up** (``start(spec, step)``, ``start(spec, step, warmup_spec)``): the
  stream sends ``warmup_spec`` (default ``none``) before ``step`` and ``spec`` from
  it on, which the paper's Figure 10 found improves quality. The decoder knows the
  schedule too and refuses a frame encoded with the wrong codec for its step;
* **warm-started codecs** (``powersgd``): the per-stream ``state`` dict.

These wrappers are registered spec values (so a job's ``codec_forward`` can say
``start(delta(fp16(svd(0.6))),1000)``) but not wire codecs: headers always name
the wire codec actually used. The same options can be given as keyword
arguments to the constructors. ``auto`` is a spec value too: it must be resolved
(``nebula_common.codec.advice_client.advise_specs``) before building a stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from nebula_common.codec.base import Codec, CodecError
from nebula_common.codec.registry import format_spec, get_codec, register_codec

DEFAULT_DELTA_CACHE = 16384
"""Samples a delta cache holds by default (each costs one activation row on both ends)."""
MAX_DELTA_CACHE = 1 << 24
AUTO = "auto"


class StreamOption(Codec):
    """A spec value that configures a stream (ef, delta, start, auto); it has no byte format."""

    wire = False

    def __init__(self, kind: str, inner: Codec | None, spec: str, **params: Any) -> None:
        self.kind = kind
        self.inner = inner
        self.spec = spec
        self.params = params

    def encoded_size(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        self._require_wire()
        return 0  # pragma: no cover - _require_wire raises

    def _encode(self, tensor: torch.Tensor) -> bytes:
        self._require_wire()
        return b""  # pragma: no cover

    def _decode(self, payload: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self._require_wire()
        return torch.empty(0)  # pragma: no cover


def _inner(name: str, inner: object) -> Codec:
    if not isinstance(inner, Codec):
        raise CodecError(f"{name} wraps a codec spec, got {inner!r}; e.g. {name}(int8)")
    if isinstance(inner, StreamOption) and inner.kind == AUTO:
        raise CodecError(f"{name}(auto) is not supported: resolve auto first, then wrap the chosen spec")
    return inner


def _ef(inner: Codec) -> Codec:
    inner = _inner("ef", inner)
    return StreamOption("ef", inner, format_spec("ef", inner.spec))


def _delta(inner: Codec, *, cache: int = DEFAULT_DELTA_CACHE) -> Codec:
    inner = _inner("delta", inner)
    if isinstance(cache, bool) or not isinstance(cache, int) or not 1 <= cache <= MAX_DELTA_CACHE:
        raise CodecError(
            f"delta cache must be an integer number of samples in [1, {MAX_DELTA_CACHE}], got {cache!r}"
        )
    spec = format_spec("delta", inner.spec, cache=None if cache == DEFAULT_DELTA_CACHE else cache)
    return StreamOption("delta", inner, spec, cache=cache)


def _start(inner: Codec, step: int, warmup: Codec | None = None) -> Codec:
    inner = _inner("start", inner)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CodecError(f"start takes the first compressed step (an integer >= 0), got {step!r}")
    if warmup is not None and (not isinstance(warmup, Codec) or not warmup.wire):
        raise CodecError(f"start's warm-up codec must be a wire codec such as none or fp16, got {warmup!r}")
    args: list[str | int] = [inner.spec, step]
    if warmup is not None and warmup.spec != "none":
        args.append(warmup.spec)
    return StreamOption("start", inner, format_spec("start", *args), step=step, warmup=warmup)


def _auto() -> Codec:
    return StreamOption(AUTO, None, AUTO)


register_codec("ef", _ef)
register_codec("delta", _delta)
register_codec("start", _start)
register_codec(AUTO, _auto)


@dataclass(frozen=True)
class StreamConfig:
    """Everything a stream end needs: the wire spec and the stateful options around it."""

    wire_spec: str
    error_feedback: bool = False
    delta: bool = False
    delta_cache: int = DEFAULT_DELTA_CACHE
    start_step: int = 0
    warmup_spec: str = "none"

    def spec_for_step(self, step: int) -> str:
        """The wire codec used at ``step``: the warm-up codec before ``start_step``."""
        return self.warmup_spec if step < self.start_step else self.wire_spec

    def canonical(self) -> str:
        """The spec string that builds this configuration (wrappers in a fixed order)."""
        spec = self.wire_spec
        if self.error_feedback:
            spec = format_spec("ef", spec)
        if self.delta:
            spec = format_spec(
                "delta", spec, cache=None if self.delta_cache == DEFAULT_DELTA_CACHE else self.delta_cache
            )
        if self.start_step or self.warmup_spec != "none":
            args: list[str | int] = [spec, self.start_step]
            if self.warmup_spec != "none":
                args.append(self.warmup_spec)
            spec = format_spec("start", *args)
        return spec


def parse_stream_spec(
    spec: str,
    *,
    error_feedback: bool = False,
    delta: bool = False,
    delta_cache: int | None = None,
    start_step: int | None = None,
    warmup_spec: str | None = None,
) -> StreamConfig:
    """Split ``spec`` into its wire codec and stream options; keyword options add to the spec's.

    Each wrapper may appear once; giving ``start_step`` both in the spec and as a
    keyword with different values is an error rather than a silent override.
    """
    codec = get_codec(spec)
    seen: set[str] = set()
    options: dict[str, Any] = {}
    while isinstance(codec, StreamOption):
        if codec.kind == AUTO:
            raise CodecError(
                "codec 'auto' must be resolved to a concrete spec before a stream is built "
                "(nebula_common.codec.advice_client.advise_specs)"
            )
        if codec.kind in seen:
            raise CodecError(f"{spec!r} applies {codec.kind} twice")
        seen.add(codec.kind)
        options[codec.kind] = codec
        assert codec.inner is not None
        codec = codec.inner
    wire_spec = codec.spec
    spec_start = options.get("start")
    spec_step = spec_start.params["step"] if spec_start is not None else None
    spec_warmup = spec_start.params["warmup"] if spec_start is not None else None
    if start_step is not None and spec_step is not None and start_step != spec_step:
        raise CodecError(f"start_step={start_step} conflicts with {spec!r}")
    warmup = (
        warmup_spec if warmup_spec is not None else (spec_warmup.spec if spec_warmup is not None else "none")
    )
    warmup_codec = get_codec(warmup)
    if not warmup_codec.wire:
        raise CodecError(f"warm-up codec must be a wire codec, got {warmup!r}")
    step = start_step if start_step is not None else (spec_step or 0)
    if step < 0:
        raise CodecError(f"start_step must be >= 0, got {step}")
    spec_delta = options.get("delta")
    cache = (
        delta_cache
        if delta_cache is not None
        else (spec_delta.params["cache"] if spec_delta else DEFAULT_DELTA_CACHE)
    )
    if not 1 <= cache <= MAX_DELTA_CACHE:
        raise CodecError(f"delta_cache must be in [1, {MAX_DELTA_CACHE}], got {cache}")
    return StreamConfig(
        wire_spec=wire_spec,
        error_feedback=error_feedback or "ef" in options,
        delta=delta or spec_delta is not None,
        delta_cache=cache,
        start_step=step,
        warmup_spec=warmup_codec.spec,
    )


class StreamOptions(TypedDict, total=False):
    """The keyword options both stream ends accept, typed once (see ``parse_stream_spec``)."""

    error_feedback: bool
    delta: bool
    delta_cache: int | None
    start_step: int | None
    warmup_spec: str | None


def canonical_spec(spec: str) -> str:
    """Validate any codec spec value a job may carry (wire codec, stream options, or ``auto``).

    Returns the canonical spelling. Unlike ``parse_stream_spec`` it accepts
    ``auto``, which the SDK resolves with the source cluster's codec service at submission
    (``nebula_common.sdk.codec_advice``); a trainer refuses a stage still carrying it.
    """
    codec = get_codec(spec)
    if isinstance(codec, StreamOption) and codec.kind == AUTO:
        return AUTO
    return parse_stream_spec(spec).canonical()
