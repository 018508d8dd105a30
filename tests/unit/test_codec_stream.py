"""Stateful stream codecs: error feedback, AQ-SGD-style delta, start-step warm-up, and their safety checks.

Encoder and decoder are separate objects exactly as the two trainers hold them;
every test passes only headers and payload bytes between them (as the WAN does).
"""

from __future__ import annotations

import pytest
import torch

from nebula_common.codec import (
    CodecError,
    TensorStreamDecoder,
    TensorStreamEncoder,
    WireFormatError,
    canonical_spec,
    get_codec,
    parse_stream_spec,
    reconstruction_error,
)
from nebula_common.codec.stream import StreamConfig

pytestmark = pytest.mark.timeout(60)


def _pair(spec: str, **options: object) -> tuple[TensorStreamEncoder, TensorStreamDecoder]:
    return TensorStreamEncoder(spec, **options), TensorStreamDecoder(spec, **options)  # type: ignore[arg-type]


def _send(
    encoder: TensorStreamEncoder,
    decoder: TensorStreamDecoder,
    x: torch.Tensor,
    step: int,
    ids: list[int] | None = None,
) -> torch.Tensor:
    encoded = encoder.encode(x, step=step, sample_ids=ids, micro_batch=0, frame_id=step + 1)
    return decoder.decode(encoded.header, encoded.payload, sample_ids=ids)


def test_config_from_spec_and_keywords_agree() -> None:
    from_spec = parse_stream_spec("start(delta(ef(int8),cache=64),100,fp16)")
    from_keywords = parse_stream_spec(
        "int8", error_feedback=True, delta=True, delta_cache=64, start_step=100, warmup_spec="fp16"
    )
    assert from_spec == from_keywords == StreamConfig("int8", True, True, 64, 100, "fp16")
    assert from_spec.canonical() == "start(delta(ef(int8),cache=64),100,fp16)"
    assert canonical_spec("START(EF(INT8), 3)") == "start(ef(int8),3)"
    assert canonical_spec("auto") == "auto"
    with pytest.raises(CodecError, match="conflicts"):
        parse_stream_spec("start(int8,5)", start_step=6)
    with pytest.raises(CodecError, match="applies ef twice"):
        parse_stream_spec("ef(ef(int8))")
    with pytest.raises(CodecError, match="must be resolved"):
        TensorStreamEncoder("auto")


def test_plain_stream_matches_the_stateless_codec() -> None:
    encoder, decoder = _pair("int8")
    x = torch.randn(4, 6)
    y = _send(encoder, decoder, x, 0)
    assert torch.equal(y, get_codec("int8").decode(get_codec("int8").encode(x), (4, 6), torch.float32))
    assert encoder.stats.tensors == decoder.stats.tensors == 1
    assert encoder.stats.ratio == pytest.approx((4 + 24) / 96)


def test_error_feedback_carries_the_residual_so_the_sum_is_preserved() -> None:
    # topk drops most of a constant-ish gradient; without EF those entries are never sent.
    generator = torch.Generator().manual_seed(0)
    gradient = torch.rand(20, 20, generator=generator) + 0.5
    steps = 60
    totals = {}
    for spec in ("topk(0.05)", "ef(topk(0.05))"):
        encoder, decoder = _pair(spec)
        received = torch.zeros_like(gradient)
        for step in range(steps):
            received += _send(encoder, decoder, gradient, step)
        totals[spec] = reconstruction_error(gradient * steps, received)["rel_l2"]
        if spec.startswith("ef"):
            # What was sent plus what is still held back is exactly what was given.
            (residual,) = encoder._residuals.values()
            assert torch.allclose(received + residual, gradient * steps, rtol=1e-5, atol=1e-4)
    assert totals["topk(0.05)"] > 0.8  # 95% of entries never arrive
    assert totals["ef(topk(0.05))"] < 0.25  # every entry arrives, only the last residual is pending


def test_error_feedback_residual_is_exactly_what_was_dropped() -> None:
    encoder, decoder = _pair("ef(int8)")
    x1, x2 = torch.randn(8, 8), torch.randn(8, 8)
    y1 = _send(encoder, decoder, x1, 0)
    y2 = _send(encoder, decoder, x2, 1)
    codec = get_codec("int8")
    expected = codec.decode(codec.encode(x2 + (x1 - y1)), (8, 8), torch.float32)
    assert torch.equal(y2, expected)
    # A tensor of another shape cannot take the residual: it is dropped and counted.
    _send(encoder, decoder, torch.randn(3, 8), 2)
    assert encoder.stats.residual_resets == 1


def test_start_step_sends_the_warmup_codec_first_and_the_decoder_enforces_the_schedule() -> None:
    encoder, decoder = _pair("start(int8,3)")
    x = torch.randn(5, 5)
    codecs = []
    for step in range(5):
        encoded = encoder.encode(x, step=step, micro_batch=0, frame_id=step)
        codecs.append(encoded.header.codec)
        y = decoder.decode(encoded.header, encoded.payload)
        if step < 3:
            assert torch.equal(y, x)
    assert codecs == ["none", "none", "none", "int8", "int8"]
    assert encoder.stats.specs == {"none": 3, "int8": 2}
    # A sender that compresses too early (or a misconfigured peer) is refused, not decoded.
    early = TensorStreamEncoder("int8").encode(x, step=1)
    with pytest.raises(WireFormatError, match="expects 'none' at step 1"):
        decoder.decode(early.header, early.payload)
    late = TensorStreamEncoder("none").encode(x, step=4)
    with pytest.raises(WireFormatError, match="expects 'int8' at step 4"):
        decoder.decode(late.header, late.payload)


def test_delta_sends_differences_and_reconstructs_revisited_samples() -> None:
    spec = "delta(int8(scale=row))"
    encoder, decoder = _pair(spec)
    generator = torch.Generator().manual_seed(1)
    base = torch.randn(6, 3, 16, generator=generator)
    ids = [10, 11, 12, 13, 14, 15]
    first = _send(encoder, decoder, base, 0, ids)
    drifted = base + 0.01 * torch.randn(6, 3, 16, generator=generator)  # the next epoch: small change
    second = _send(encoder, decoder, drifted, 1, ids)
    plain = get_codec("int8(scale=row)")
    direct = plain.decode(plain.encode(drifted), tuple(drifted.shape), torch.float32)
    delta_error = reconstruction_error(drifted, second)["rel_l2"]
    assert delta_error < reconstruction_error(drifted, direct)["rel_l2"] / 10
    assert reconstruction_error(base, first)["rel_l2"] < 0.01
    assert encoder.stats.delta_hits == 6 and encoder.stats.delta_rows == 12
    # A batch mixing new and cached samples: new rows are sent against a zero base.
    mixed = torch.cat([drifted[:3], torch.randn(3, 3, 16, generator=generator)])
    out = _send(encoder, decoder, mixed, 2, [10, 11, 12, 20, 21, 22])
    assert reconstruction_error(mixed, out)["rel_l2"] < 0.01


def test_delta_caches_are_identical_and_divergence_is_detected() -> None:
    encoder, decoder = _pair("delta(int8)")
    x = torch.randn(4, 8)
    _send(encoder, decoder, x, 0, [1, 2, 3, 4])
    lost = encoder.encode(x + 1, step=1, sample_ids=[1, 2, 3, 4])  # never delivered: caches diverge
    del lost
    stale = encoder.encode(x + 2, step=2, sample_ids=[1, 2, 3, 4])
    with pytest.raises(WireFormatError, match="caches diverged"):
        decoder.decode(stale.header, stale.payload, sample_ids=[1, 2, 3, 4])


def test_delta_header_fields_are_covered_by_the_checksum() -> None:
    encoder, decoder = _pair("delta(int8)")
    x = torch.randn(2, 8)
    _send(encoder, decoder, x, 0, [5, 6])
    encoded = encoder.encode(x * 1.1, step=1, sample_ids=[5, 6])
    assert encoded.header.delta and encoded.header.delta_base_checksum != 0
    encoded.header.delta = False
    with pytest.raises(WireFormatError):
        decoder.decode(encoded.header, encoded.payload, sample_ids=[5, 6])


def test_delta_needs_consistent_sample_ids() -> None:
    encoder, decoder = _pair("delta(fp16)")
    x = torch.randn(3, 4)
    with pytest.raises(CodecError, match="needs sample_ids"):
        encoder.encode(x, step=0)
    with pytest.raises(CodecError, match="3 rows"):
        encoder.encode(x, step=0, sample_ids=[1, 2])
    with pytest.raises(CodecError, match="duplicates"):
        encoder.encode(x, step=0, sample_ids=[1, 1, 2])
    encoded = encoder.encode(x, step=0, sample_ids=[1, 2, 3])
    with pytest.raises(CodecError, match="needs sample_ids"):
        decoder.decode(encoded.header, encoded.payload)
    plain = TensorStreamDecoder("fp16")
    with pytest.raises(WireFormatError, match="not configured with delta"):
        plain.decode(encoded.header, encoded.payload)


def test_delta_cache_is_bounded_and_evicts_identically_on_both_ends() -> None:
    encoder, decoder = _pair("delta(int8,cache=4)")
    for step in range(6):
        ids = [step * 2, step * 2 + 1]
        _send(encoder, decoder, torch.randn(2, 5), step, ids)
    assert len(encoder._cache) == len(decoder._cache) == 4  # type: ignore[arg-type]
    assert list(encoder._cache._rows) == list(decoder._cache._rows) == [8, 9, 10, 11]  # type: ignore[union-attr]


def test_delta_with_warmup_fills_the_cache_exactly_then_sends_deltas() -> None:
    encoder, decoder = _pair("start(delta(int8),2)")
    x = torch.randn(3, 7)
    ids = [7, 8, 9]
    assert torch.equal(_send(encoder, decoder, x, 0, ids), x)
    encoded = encoder.encode(x, step=2, sample_ids=ids)
    assert encoded.header.delta
    y = decoder.decode(encoded.header, encoded.payload, sample_ids=ids)
    assert torch.equal(y, x)  # the difference from an exact cache is zero


def test_powersgd_stream_keeps_its_warm_start_per_encoder() -> None:
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(100, 8, generator=generator) @ torch.randn(8, 60, generator=generator)
    x += 0.05 * torch.randn(100, 60, generator=generator)
    encoder, decoder = _pair("powersgd(4)")
    errors = [reconstruction_error(x, _send(encoder, decoder, x, step))["rel_l2"] for step in range(5)]
    assert errors[-1] < errors[0]


def test_measured_error_and_fallback_notes_are_reported() -> None:
    encoder = TensorStreamEncoder("fp16(svd(0.9))", measure_error=True)
    encoded = encoder.encode(torch.randn(16, 16), step=0)
    assert encoder.stats.fallbacks == 1 and "sent whole with fp16" in encoder.stats.last_note
    assert encoded.note == encoder.stats.last_note
    assert encoder.stats.last_rel_error is not None and encoder.stats.last_rel_error < 1e-3
