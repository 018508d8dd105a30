"""Per-edge, per-direction codec endpoints: the seam between a trainer and the codec library.

A trainer owns one ``TensorStreamEncoder`` for each (edge, direction) it sends on
and one ``TensorStreamDecoder`` for each it receives on. Stateful techniques (error
feedback residuals, the delta cache, warm-started codec state) live behind these two
objects, so training code only ever says "send this tensor of step s for these samples"
and never touches codec state; the options themselves are described in ``stream_options``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Unpack

import torch

from nebula_common.codec.base import CodecError, check_input, reconstruction_error
from nebula_common.codec.delta_cache import DeltaCache, _base_checksum, _sample_ids
from nebula_common.codec.registry import get_codec
from nebula_common.codec.row_elision import Rows, pack, unpack, zero_rows
from nebula_common.codec.stream_options import StreamOptions, parse_stream_spec
from nebula_common.codec.wire_header import EncodedTensor, WireFormatError
from nebula_common.codec.wire_tensor import decode_tensor, encode_tensor
from nebula_common.proto.nebula.v1 import tensor_pb2


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


class StreamEnd:
    """What both ends of one edge direction hold: the parsed config, the stats and (with delta) the cache.

    One constructor for both ends, so an encoder and a decoder given the same spec and
    options cannot parse them differently.
    """

    def __init__(self, spec: str, **options: Unpack[StreamOptions]) -> None:
        self.config = parse_stream_spec(spec, **options)
        self.spec = self.config.wire_spec
        self.stats = StreamStats()
        self._cache = DeltaCache(self.config.delta_cache) if self.config.delta else None


class TensorStreamEncoder(StreamEnd):
    """Encodes the successive tensors of one edge direction; holds EF residuals, delta cache, codec state."""

    def __init__(self, spec: str, *, measure_error: bool = False, **options: Unpack[StreamOptions]) -> None:
        super().__init__(spec, **options)
        self.measure_error = measure_error
        self._state: dict[str, object] = {}
        self._residuals: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}

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
        # Rows that are zero in what the trainer sent (padding) stay home; decided before error
        # feedback adds its residual, which those rows then drop: padding carries no signal to correct.
        rows: Rows | None = zero_rows(x) if self._cache is None else None
        use_ef = config.error_feedback and compressing
        if use_ef:
            residual = self._residuals.get(key)
            if residual is None and self._residuals:
                self.stats.residual_resets += 1  # shape changed: residual of another shape cannot apply
            if residual is not None:
                target = target + residual
        sent = target if rows is None else pack(target, rows)
        encoded = encode_tensor(
            sent,
            spec,
            state=self._state,
            delta_base_checksum=base_crc,
            borrow=borrow and rows is None,
            rows=rows,
            step=step,
            **header_fields,
        )
        need_decoded = use_ef or self._cache is not None or self.measure_error
        if need_decoded:
            decoded = (
                sent if codec.spec == "none" else codec.decode(encoded.payload, tuple(sent.shape), x.dtype)
            )
            if rows is not None:
                decoded = unpack(decoded, rows)
                if use_ef:
                    target = unpack(sent, rows)  # the residual of a row left out is dropped, not carried
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


class TensorStreamDecoder(StreamEnd):
    """Decodes the successive tensors of one edge direction (the mirror of the encoder)."""

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
