"""Per-edge, per-direction codec endpoints: the seam between a trainer and the codec library.

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

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nebula_common.codec.base import Codec, CodecError, check_input, reconstruction_error, tensor_to_bytes
from nebula_common.codec.checksum import crc32
from nebula_common.codec.registry import format_spec, get_codec, register_codec
from nebula_common.codec.wire import EncodedTensor, WireFormatError, decode_tensor, encode_tensor
from nebula_common.proto.nebula.v1 import tensor_pb2

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


class DeltaCache:
    """Per-sample rows, LRU-bounded; both stream ends apply the same operations in the same order.

    Reads never change the LRU order (only ``store`` does), so the sender's
    lookups for encoding and the receiver's for decoding cannot make the two
    caches evict differently.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._rows: OrderedDict[int, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def base(self, ids: Sequence[int], like: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Cached rows for ``ids`` stacked like ``like`` (zeros where absent or reshaped), and hits."""
        base = torch.zeros_like(like)
        hits = 0
        row_shape = tuple(like.shape[1:])
        for position, sample in enumerate(ids):
            row = self._rows.get(sample)
            if row is not None and tuple(row.shape) == row_shape and row.dtype == like.dtype:
                base[position] = row
                hits += 1
        return base, hits

    def store(self, ids: Sequence[int], rows: torch.Tensor) -> None:
        for position, sample in enumerate(ids):
            self._rows[sample] = rows[position].clone()
            self._rows.move_to_end(sample)
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)


def _sample_ids(ids: Sequence[int] | None, tensor_rows: int, what: str) -> list[int]:
    if ids is None:
        raise CodecError(f"delta compression needs sample_ids to {what} (one id per row of dim 0)")
    ids = [int(sample) for sample in ids]
    if len(ids) != tensor_rows:
        raise CodecError(f"delta: {len(ids)} sample_ids for a tensor with {tensor_rows} rows in dim 0")
    if len(set(ids)) != len(ids):
        raise CodecError("delta: sample_ids contain duplicates; each row must be a distinct sample")
    return ids


def _base_checksum(base: torch.Tensor) -> int:
    """CRC-32 of the base's little-endian bytes: what ``TensorHeader.delta_base_checksum`` carries."""
    return crc32(tensor_to_bytes(base))


@dataclass
class StreamStats:
    """What one stream end did: tensors, bytes, the achieved ratio and the last reconstruction error."""

    tensors: int = 0
    payload_bytes: int = 0
    raw_bytes: int = 0
    fallbacks: int = 0
    last_note: str = ""
    last_rel_error: float | None = None
    delta_hits: int = 0
    delta_rows: int = 0
    residual_resets: int = 0
    specs: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """Payload bytes / raw bytes over everything so far (0 before the first tensor)."""
        return self.payload_bytes / self.raw_bytes if self.raw_bytes else 0.0


class TensorStreamEncoder:
    """Encodes the successive tensors of one edge direction; holds EF residuals, delta cache, codec state."""

    def __init__(
        self,
        spec: str,
        *,
        error_feedback: bool = False,
        delta: bool = False,
        delta_cache: int | None = None,
        start_step: int | None = None,
        warmup_spec: str | None = None,
        measure_error: bool = False,
    ) -> None:
        self.config = parse_stream_spec(
            spec,
            error_feedback=error_feedback,
            delta=delta,
            delta_cache=delta_cache,
            start_step=start_step,
            warmup_spec=warmup_spec,
        )
        self.spec = self.config.wire_spec
        self.measure_error = measure_error
        self.stats = StreamStats()
        self._state: dict[str, object] = {}
        self._residuals: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self._cache = DeltaCache(self.config.delta_cache) if self.config.delta else None

    def encode(
        self,
        tensor: torch.Tensor,
        *,
        step: int,
        sample_ids: Sequence[int] | None = None,
        borrow: bool = False,
        **header_fields: Any,
    ) -> EncodedTensor:
        """Encode one tensor of ``step``; ``sample_ids`` name the rows (required with delta).

        ``borrow``: see ``encode_tensor`` (a codec ``none`` payload viewing the tensor, not a copy)."""
        config = self.config
        x = check_input(tensor)
        spec = config.spec_for_step(step)
        codec = get_codec(spec)
        compressing = step >= config.start_step
        ids: list[int] | None = None
        base: torch.Tensor | None = None
        base_crc: int | None = None
        target = x
        if self._cache is not None:
            if x.dim() == 0:
                raise CodecError("delta compression needs a tensor with a sample dimension (dim 0)")
            ids = _sample_ids(sample_ids, x.shape[0], "encode")
            if compressing:
                base, hits = self._cache.base(ids, x)
                base_crc = _base_checksum(base)
                target = x - base
                self.stats.delta_hits += hits
                self.stats.delta_rows += len(ids)
        key = (tuple(x.shape), x.dtype)
        use_ef = config.error_feedback and compressing
        if use_ef:
            residual = self._residuals.get(key)
            if residual is None and self._residuals:
                self.stats.residual_resets += 1  # shape changed: residual of another shape cannot apply
            if residual is not None:
                target = target + residual
        encoded = encode_tensor(
            target,
            spec,
            state=self._state,
            delta_base_checksum=base_crc,
            borrow=borrow,
            step=step,
            **header_fields,
        )
        need_decoded = use_ef or self._cache is not None or self.measure_error
        if need_decoded:
            decoded = (
                target if codec.spec == "none" else codec.decode(encoded.payload, tuple(x.shape), x.dtype)
            )
            if use_ef:
                self._residuals = {key: target - decoded}
            if self._cache is not None and ids is not None:
                self._cache.store(ids, decoded if base is None else base + decoded)
            if self.measure_error:
                self.stats.last_rel_error = reconstruction_error(target, decoded)["rel_l2"]
        self._record(encoded)
        return encoded

    def _record(self, encoded: EncodedTensor) -> None:
        stats = self.stats
        stats.tensors += 1
        stats.payload_bytes += encoded.header.payload_size
        stats.raw_bytes += encoded.header.raw_size
        stats.specs[encoded.header.codec] = stats.specs.get(encoded.header.codec, 0) + 1
        if encoded.note:
            stats.fallbacks += 1
            stats.last_note = encoded.note


class TensorStreamDecoder:
    """Decodes the successive tensors of one edge direction (the mirror of the encoder)."""

    def __init__(
        self,
        spec: str,
        *,
        error_feedback: bool = False,
        delta: bool = False,
        delta_cache: int | None = None,
        start_step: int | None = None,
        warmup_spec: str | None = None,
    ) -> None:
        self.config = parse_stream_spec(
            spec,
            error_feedback=error_feedback,
            delta=delta,
            delta_cache=delta_cache,
            start_step=start_step,
            warmup_spec=warmup_spec,
        )
        self.spec = self.config.wire_spec
        self.stats = StreamStats()
        self._cache = DeltaCache(self.config.delta_cache) if self.config.delta else None

    def decode(
        self,
        header: tensor_pb2.TensorHeader,
        payload: bytes,
        *,
        sample_ids: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Validate and decode one received tensor; the header says how, the config what to expect."""
        expected = self.config.spec_for_step(header.step)
        try:
            sent = get_codec(header.codec).spec
        except CodecError as exc:
            raise WireFormatError(f"codec: {exc}") from None
        if sent != expected:
            raise WireFormatError(
                f"codec: header says {header.codec!r} but this stream expects {expected!r} "
                f"at step {header.step}"
                f" (configured {self.config.canonical()!r}); both ends must use the same codec settings"
            )
        if header.delta and self._cache is None:
            raise WireFormatError("delta: frame is a delta but this stream was not configured with delta")
        if self._cache is not None and header.delta != (header.step >= self.config.start_step):
            raise WireFormatError(
                f"delta: frame of step {header.step} has delta={header.delta} but this stream sends deltas "
                f"from step {self.config.start_step} on"
            )
        decoded = decode_tensor(header, payload)
        if self._cache is not None:
            if decoded.dim() == 0:
                raise WireFormatError("delta: stream tensors need a sample dimension (dim 0)")
            ids = _sample_ids(sample_ids, decoded.shape[0], "decode")
            if header.delta:
                base, _ = self._cache.base(ids, decoded)
                crc = _base_checksum(base)
                if crc != header.delta_base_checksum:
                    raise WireFormatError(
                        f"delta_base_checksum: sender's base CRC-32 is {header.delta_base_checksum:#010x} "
                        f"but this receiver's cache gives {crc:#010x}; the caches diverged "
                        "(lost or reordered frames)"
                    )
                decoded = base + decoded
            self._cache.store(ids, decoded)
        self.stats.tensors += 1
        self.stats.payload_bytes += header.payload_size
        self.stats.raw_bytes += header.raw_size
        self.stats.specs[sent] = self.stats.specs.get(sent, 0) + 1
        return decoded


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
