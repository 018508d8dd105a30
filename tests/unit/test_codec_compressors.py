"""The compression codecs: grammar, exact sizes, error bounds, low-rank fallback, zstd, top-k.

Every spec the issue names must parse and round-trip to its canonical spelling;
every fixed-size codec's payload length is pinned by a formula computed here
independently; every lossy codec has an error bound that a regression would break.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from nebula_common.codec import (
    CodecError,
    canonical_spec,
    decode_tensor,
    encode_tensor,
    get_codec,
    parse_direction_pair,
    reconstruction_error,
)
from nebula_common.codec.registry import parse_spec
from nebula_common.codec.sparse import index_encoding, pack_indices, unpack_indices

pytestmark = pytest.mark.timeout(60)


def _data(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator)


def _low_rank(m: int, n: int, rank: int, noise: float = 0.0, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    data = torch.randn(m, rank, generator=generator) @ torch.randn(rank, n, generator=generator)
    return data + noise * torch.randn(m, n, generator=generator)


def _round_trip(spec: str, x: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    codec = get_codec(spec)
    payload = codec.encode(x)
    return payload, codec.decode(payload, tuple(x.shape), x.dtype)


# --- grammar ------------------------------------------------------------------------------------------

CANONICAL = [
    "none",
    "fp16",
    "bf16",
    "int8",
    "int8(scale=row)",
    "int8(scale=block)",
    "int8(block=32,scale=block)",
    "int8(rounding=stochastic)",
    "int8(rounding=stochastic,scale=row)",
    "int8(error=0.04)",
    "zstd(int8(error=0.2))",
    "int4",
    "int4(block=32)",
    "topk(0.01)",
    "svd(0.6)",
    "lowrank(8)",
    "powersgd(4)",
    "zstd(3)",
    "zstd(9)",
    "zstd(int8)",
    "zstd(int8,9)",
    "fp16(svd(0.6))",
    "bf16(lowrank(16))",
    "int8(svd(0.5))",
    "int8(powersgd(8),scale=row)",
    "int4(topk(0.1))",
    "fp16(topk(0.05))",
    "zstd(fp16(svd(0.6)))",
    "ef(int8)",
    "delta(int8(scale=row))",
    "delta(int8,cache=100)",
    "start(fp16(svd(0.6)),1000)",
    "start(int8,10,fp16)",
    "start(delta(ef(int8)),5)",
    "auto",
]


@pytest.mark.parametrize("spec", CANONICAL)
def test_every_spec_round_trips_through_the_grammar(spec: str) -> None:
    codec = get_codec(spec)
    assert codec.spec == spec
    assert str(parse_spec(spec)) == spec
    assert get_codec(codec.spec) is codec
    assert get_codec(spec.upper().replace(",", " , ")).spec == spec  # case and spacing do not matter


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("INT8(SCALE=TENSOR)", "int8"),
        ("int8(scale = block , block = 64)", "int8(scale=block)"),
        ("int8(block=64)", "int8(scale=block)"),
        ("int8(scale=block, block=128)", "int8(block=128,scale=block)"),
        ("int8(rounding=nearest)", "int8"),
        ("int4(block=64)", "int4"),
        ("zstd", "zstd(3)"),
        ("zstd(none)", "zstd(3)"),
        ("zstd(int8,3)", "zstd(int8)"),
        ("delta(int8,cache=16384)", "delta(int8)"),
        ("start(int8,10,none)", "start(int8,10)"),
        ("svd(1)", "svd(1)"),
        ("int8(error=.05)", "int8(error=0.05)"),
        ("int8(error=1)", "int8(error=1.0)"),
    ],
)
def test_defaults_are_dropped_from_the_canonical_spelling(text: str, canonical: str) -> None:
    assert get_codec(text).spec == canonical


@pytest.mark.parametrize(
    ("text", "forward", "backward"),
    [
        ("FP16+INT8", "fp16", "int8"),
        ("FP16(SVD(0.9))+INT8", "fp16(svd(0.9))", "int8"),
        ("FP16(SVD(0.6))+INT8", "fp16(svd(0.6))", "int8"),
        ("FP16(SVD(0.2))+INT8", "fp16(svd(0.2))", "int8"),
    ],
)
def test_table5_specs_parse_as_written(text: str, forward: str, backward: str) -> None:
    assert parse_direction_pair(text) == (forward, backward)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("svd", "svd takes arguments"),
        ("svd(0)", "in (0, 1]"),
        ("svd(1.5)", "in (0, 1]"),
        ("lowrank(0)", "rank (an integer >= 1)"),
        ("lowrank(2.5)", "rank (an integer >= 1)"),
        ("topk(0)", "fraction of entries"),
        ("zstd(30)", "zstd level must be an integer in [1, 19]"),
        ("zstd(zstd(int8))", "zstd inside zstd"),
        ("zstd(1,2)", "not two numbers"),
        ("fp16(int8(svd(0.5)))", "already stores its parts as int8"),
        ("int8(fp16(svd(0.5)))", "already stores its parts as fp16"),
        ("int8(block=64,scale=row)", "only applies to scale=block"),
        ("int8(scale=row,scale=block)", "given twice"),
        ("int8(scale=row,svd(0.5))", "positional argument after keyword"),
        ("int8(scale=(1))", "needs a number or a word"),
        ("int8(error=0)", "relative L2 error in (0, 1]"),
        ("int8(error=1.5)", "relative L2 error in (0, 1]"),
        ("int8(error=row)", "relative L2 error in (0, 1]"),
        ("int8(error=0.1,scale=row)", "does not combine with scale=row"),
        ("int8(error=0.1,rounding=stochastic)", "does not combine with rounding=stochastic"),
        ("ef(0.5)", "ef wraps a codec spec"),
        ("ef(auto)", "resolve auto first"),
        ("start(int8,-1)", "first compressed step"),
        ("start(int8,5,ef(int8))", "warm-up codec must be a wire codec"),
        ("delta(int8,cache=0)", "delta cache must be"),
        ("fp16(ef(svd(0.5)))", "fp16 can only wrap"),
        ("zstd(ef(int8))", "fixed-size inner codec"),
    ],
)
def test_invalid_specs_fail_with_a_message_naming_the_problem(text: str, message: str) -> None:
    with pytest.raises(CodecError) as info:
        canonical_spec(text)
    assert message in str(info.value)


def test_stream_options_have_no_byte_format() -> None:
    for spec in ("ef(int8)", "auto", "start(int8,3)"):
        codec = get_codec(spec)
        assert not codec.wire
        with pytest.raises(CodecError, match="configures a tensor stream"):
            codec.encode(torch.ones(3))
        with pytest.raises(CodecError, match="configures a tensor stream"):
            codec.decode(b"", (3,), torch.float32)
        with pytest.raises(CodecError, match="configures a tensor stream"):
            encode_tensor(torch.ones(3), spec)


# --- exact sizes ------------------------------------------------------------------------------------


def _svd_size(m: int, n: int, ratio: float, bytes_per_value: int) -> int:
    k = min(min(m, n), max(1, math.floor(ratio * min(m, n) + 0.5)))
    return 1 + bytes_per_value * (m * k + k + k * n)  # formula (4) plus the mode byte


@pytest.mark.parametrize(
    ("spec", "shape", "expected"),
    [
        ("int8(scale=row)", (6, 10), 4 * 6 + 60),
        ("int8(scale=block)", (6, 10), 4 * 1 + 60),
        ("int8(block=7,scale=block)", (6, 10), 4 * 9 + 60),
        ("int8(rounding=stochastic)", (6, 10), 4 + 60),
        ("int4", (6, 10), 4 * 1 + 30),
        ("int4(block=8)", (3, 3), 4 * 2 + 5),
        ("svd(0.25)", (512, 64), _svd_size(512, 64, 0.25, 4)),
        ("fp16(svd(0.6))", (64, 12, 128), _svd_size(768, 128, 0.6, 2)),
        ("fp16(svd(0.2))", (1024, 256), _svd_size(1024, 256, 0.2, 2)),
        ("lowrank(8)", (300, 200), 1 + 4 * 8 * (300 + 200)),
        ("fp16(powersgd(4))", (50, 40), 1 + 2 * 4 * (50 + 40)),
        ("int8(lowrank(8))", (300, 200), 1 + (4 + 300 * 8) + (4 + 200 * 8)),
    ],
)
def test_fixed_size_codecs_produce_exactly_their_formula(
    spec: str, shape: tuple[int, ...], expected: int
) -> None:
    codec = get_codec(spec)
    assert not codec.variable_size
    assert codec.encoded_size(shape, torch.float32) == expected
    x = _data(shape)
    payload = codec.encode(x)
    assert len(payload) == expected
    encoded = encode_tensor(x, spec)
    assert encoded.header.payload_size == expected
    assert encoded.ratio == pytest.approx(expected / (x.numel() * 4))
    assert decode_tensor(encoded.header, encoded.payload).shape == x.shape


def test_paper_ratio_of_table5_is_reproduced_for_tall_activations() -> None:
    # Table 5: FP16(SVD(r)) forward ratio = 0.5 * R_svd; with m >> n, R_svd ~ r.
    shape = (4096, 128)
    for ratio, paper in ((0.6, 0.30), (0.5, 0.25), (0.2, 0.09)):
        size = get_codec(f"fp16(svd({ratio}))").encoded_size(shape, torch.float32)
        assert size / (4096 * 128 * 4) == pytest.approx(paper, abs=0.02)


def test_low_rank_that_would_inflate_falls_back_to_its_inner_codec_and_says_why() -> None:
    codec = get_codec("fp16(svd(0.9))")
    shape = (64, 12, 128)  # 768 x 128: factors pay only for rank < 768*128/897 = 109.6
    note = codec.plan_note(shape, torch.float32)
    assert "rank 115 of 128" in note and "mn/(m+n+1) = 109.6" in note and "sent whole with fp16" in note
    assert codec.encoded_size(shape, torch.float32) == 1 + get_codec("fp16").encoded_size(
        shape, torch.float32
    )
    x = _data(shape)
    encoded = encode_tensor(x, "fp16(svd(0.9))")
    assert encoded.note == note
    assert encoded.payload[0] == 1  # dense mode
    y = decode_tensor(encoded.header, encoded.payload)
    assert reconstruction_error(x, y)["rel_l2"] < 1e-3  # fp16 quality, not a rank-115 approximation
    # Vectors and empty tensors have no factorisation: also dense, also explained.
    assert "not a non-empty matrix" in get_codec("svd(0.5)").plan_note((10,), torch.float32)
    _, y = _round_trip("lowrank(4)", torch.arange(10.0))
    assert torch.equal(y, torch.arange(10.0))


def test_low_rank_is_never_larger_than_its_inner_codec() -> None:
    for spec, inner in (("fp16(svd(0.5))", "fp16"), ("int8(lowrank(64))", "int8"), ("topk(0.9)", "none")):
        for shape in ((8, 8), (100, 3), (64, 64), (1000, 10), (5,)):
            size = get_codec(spec).encoded_size(shape, torch.float32)
            assert size <= 1 + get_codec(inner).encoded_size(shape, torch.float32)


# --- error bounds -------------------------------------------------------------------------------------


def test_int8_row_and_block_scaling_bound_each_group_by_its_own_scale() -> None:
    x = _data((16, 64))
    x[:, 3] *= 1000.0  # one outlier channel: per-tensor scaling would flatten everything else
    for spec, groups in (("int8(scale=row)", x.reshape(16, 64)), ("int8(scale=block)", x.reshape(-1, 64))):
        payload, y = _round_trip(spec, x)
        scales = struct.unpack(f"<{groups.shape[0]}f", payload[: 4 * groups.shape[0]])
        err = (x - y).abs().reshape(groups.shape)
        for row, scale in enumerate(scales):
            assert scale == pytest.approx(float(groups[row].abs().max()) / 127, rel=1e-6)
            assert float(err[row].max()) <= scale / 2 * (1 + 1e-5)
    per_tensor = reconstruction_error(x, _round_trip("int8", x)[1])["rel_l2"]
    blockwise = reconstruction_error(x, _round_trip("int8(block=16)", x)[1])["rel_l2"]
    assert blockwise < per_tensor


def test_int8_stochastic_rounding_is_unbiased_and_within_one_step() -> None:
    x = torch.full((20000,), 0.305)  # 30.5 quantization steps: nearest rounding is biased to 30
    x[0] = 1.27  # absmax: scale 0.01
    payload, y = _round_trip("int8(rounding=stochastic)", x)
    (scale,) = struct.unpack("<f", payload[:4])
    assert float((x - y).abs().max()) <= scale * (1 + 1e-5)
    assert float(y[1:].mean()) == pytest.approx(0.305, abs=2e-4)
    low, high = torch.isclose(y[1:], torch.tensor(0.30)), torch.isclose(y[1:], torch.tensor(0.31))
    assert bool((low | high).all()) and bool(low.any()) and bool(high.any())
    nearest = _round_trip("int8", x)[1]
    assert abs(float(nearest[1:].mean()) - 0.305) > 4e-3


@pytest.mark.parametrize("target", [0.01, 0.04, 0.2])
def test_int8_error_spends_the_target_in_plain_int8s_layout(target: float) -> None:
    x = _data((433, 64))  # activation-like: the Table 5 cut's real rows are near-Gaussian
    payload, y = _round_trip(f"int8(error={target})", x)
    assert len(payload) == len(get_codec("int8").encode(x))
    assert get_codec("int8").decode(payload, tuple(x.shape), x.dtype).equal(y)  # decoding is unchanged
    assert reconstruction_error(x, y)["rel_l2"] == pytest.approx(target, rel=0.05)


def test_zstd_of_int8_error_beats_int4_at_int4s_own_error() -> None:
    x = _data((433, 64))
    int4_error = reconstruction_error(x, _round_trip("int4", x)[1])["rel_l2"]
    spec = f"zstd(int8(error={int4_error:.4f}))"
    payload, y = _round_trip(spec, x)
    assert reconstruction_error(x, y)["rel_l2"] <= int4_error * 1.02
    assert len(payload) < 0.95 * len(get_codec("zstd(int4)").encode(x))  # entropy coding, not 4 fixed bits
    assert len(payload) < 0.6 * len(get_codec("zstd(int8)").encode(x))


def test_int8_error_never_clips_an_outlier() -> None:
    x = _data((64, 64))
    x[0, 0] = 1000.0  # absmax / 127 is far coarser than the target step: the outlier sets it
    payload, y = _round_trip("int8(error=0.01)", x)
    (scale,) = struct.unpack("<f", payload[:4])
    assert scale == pytest.approx(1000.0 / 127, rel=1e-6)
    assert float((x - y).abs().max()) <= scale / 2 * (1 + 1e-5)
    assert float(y[0, 0]) == pytest.approx(1000.0, rel=1e-6)


def test_int4_bound_odd_lengths_and_layout() -> None:
    x = _data((3, 7))
    payload, y = _round_trip("int4(block=8)", x)
    flat = x.reshape(-1)
    scales = struct.unpack("<3f", payload[:12])
    for block, scale in enumerate(scales):
        part = flat[block * 8 : (block + 1) * 8]
        assert scale == pytest.approx(float(part.abs().max()) / 7, rel=1e-6)
        assert float((part - y.reshape(-1)[block * 8 : (block + 1) * 8]).abs().max()) <= scale / 2 * (
            1 + 1e-5
        )
    assert payload[-1] >> 4 == 8  # the spare nibble after 21 codes encodes zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_new_codecs_keep_dtype_and_handle_zeros_and_empty(dtype: torch.dtype) -> None:
    for spec in (
        "int8(scale=row)",
        "int4",
        "topk(0.5)",
        "fp16(svd(0.5))",
        "lowrank(2)",
        "zstd(int8)",
        "zstd(int8(error=0.1))",
    ):
        for x in (torch.zeros(6, 5, dtype=dtype), torch.zeros(0, 5, dtype=dtype), _data((6, 5)).to(dtype)):
            encoded = encode_tensor(x, spec)
            y = decode_tensor(encoded.header, encoded.payload)
            assert y.dtype == dtype and y.shape == x.shape
            if not x.any():
                assert not y.any()


def test_svd_is_exact_at_full_rank_and_optimal_when_truncated() -> None:
    x = _low_rank(40, 30, 30)
    _, y = _round_trip("svd(1)", x)  # full rank would inflate, so it falls back to float32: bit-exact
    assert torch.equal(y, x)
    x = _low_rank(200, 100, 5, noise=0.01)
    _, y = _round_trip("svd(0.05)", x)  # rank 5 of 100
    singular = torch.linalg.svdvals(x.double())
    optimum = float(singular[5:].square().sum().sqrt() / singular.square().sum().sqrt())
    assert reconstruction_error(x, y)["rel_l2"] == pytest.approx(optimum, rel=1e-3)


@pytest.mark.parametrize("spec", ["lowrank(6)", "powersgd(6)"])
def test_fast_low_rank_recovers_a_low_rank_matrix(spec: str) -> None:
    x = _low_rank(300, 120, 6)
    _, y = _round_trip(spec, x)
    assert reconstruction_error(x, y)["rel_l2"] < 1e-4


def test_lowrank_error_is_within_ten_percent_of_eckart_young() -> None:
    generator = torch.Generator().manual_seed(3)
    spectrum = torch.logspace(0, -2, 128)
    u, _ = torch.linalg.qr(torch.randn(600, 128, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(128, 128, generator=generator))
    x = (u * spectrum) @ v.T
    for rank in (8, 24):
        _, y = _round_trip(f"lowrank({rank})", x)
        optimum = float(spectrum[rank:].square().sum().sqrt() / spectrum.square().sum().sqrt())
        assert reconstruction_error(x, y)["rel_l2"] <= optimum * 1.10


def test_powersgd_warm_start_converges_over_calls_on_one_stream() -> None:
    x = _low_rank(200, 80, 12, noise=0.05, seed=5)
    codec = get_codec("powersgd(4)")
    cold = reconstruction_error(x, codec.decode(codec.encode(x), (200, 80), torch.float32))["rel_l2"]
    state: dict[str, object] = {}
    errors = []
    for _ in range(6):
        payload = codec.encode(x, state)
        errors.append(reconstruction_error(x, codec.decode(payload, (200, 80), torch.float32))["rel_l2"])
    singular = torch.linalg.svdvals(x.double())
    optimum = float(singular[4:].square().sum().sqrt() / singular.square().sum().sqrt())
    assert errors[-1] <= errors[0] + 1e-6
    assert errors[-1] <= min(cold, errors[0])
    assert errors[-1] == pytest.approx(optimum, rel=0.05)
    assert len(state) == 1


def test_low_rank_rejects_non_finite_input() -> None:
    x = _data((20, 10))
    x[3, 3] = math.nan
    for spec in ("svd(0.3)", "lowrank(2)", "topk(0.1)"):
        with pytest.raises(CodecError, match="non-finite"):
            get_codec(spec).encode(x)


# --- top-k ---------------------------------------------------------------------------------------------


def test_topk_keeps_exactly_the_largest_entries() -> None:
    x = _data((50, 40))
    _, y = _round_trip("topk(0.05)", x)
    k = 100
    kept = y != 0
    assert int(kept.sum()) == k
    threshold = x.abs().flatten().kthvalue(x.numel() - k + 1).values
    assert bool((x.abs()[kept] >= threshold).all())
    assert torch.equal(y[kept], x[kept])


@pytest.mark.parametrize(
    ("n", "k", "encoding"), [(4096, 40, "packed"), (4096, 1000, "bitmap"), (10, 1, "packed")]
)
def test_topk_picks_the_smaller_index_encoding(n: int, k: int, encoding: str) -> None:
    chosen, _, size = index_encoding(n, k)
    assert chosen == encoding
    assert size == min((n + 7) // 8, (k * max(1, (n - 1).bit_length()) + 7) // 8)
    fraction = k / n
    x = _data((n,))
    codec = get_codec(f"topk({fraction!r})")
    payload = codec.encode(x)
    assert len(payload) == 1 + size + 4 * k
    assert int((codec.decode(payload, (n,), torch.float32) != 0).sum()) == k


def test_topk_index_packing_round_trips_and_validates() -> None:
    indices = torch.tensor([0, 5, 17, 4095]).numpy().astype("uint64")
    data = pack_indices(indices, 12)
    assert len(data) == 6
    assert unpack_indices(data, 4, 12).tolist() == [0, 5, 17, 4095]
    with pytest.raises(CodecError, match="padding"):
        unpack_indices(data[:-1] + b"\x01", 3, 12)
    x = _data((64, 64))
    codec = get_codec("topk(0.005)")  # 20 of 4096: packed 12-bit indices
    payload = bytearray(codec.encode(x))
    payload[1:4] = b"\xff\xff\xff"  # first two indices become 4095, 4095...: not increasing
    with pytest.raises(CodecError, match=r"strictly increasing|out of range"):
        codec.decode(bytes(payload), (64, 64), torch.float32)
    dense = get_codec("topk(0.5)")  # bitmap
    payload = bytearray(dense.encode(x))
    payload[1] ^= 0xFF
    with pytest.raises(CodecError, match="bitmap marks"):
        dense.decode(bytes(payload), (64, 64), torch.float32)


# --- zstd ----------------------------------------------------------------------------------------------


def test_zstd_is_lossless_over_its_inner_codec_and_never_much_larger() -> None:
    x = torch.round(_data((128, 64)) * 4) / 4  # few distinct int8 codes: compresses well
    inner = get_codec("int8").encode(x)
    payload, y = _round_trip("zstd(int8)", x)
    assert payload[0] == 1 and len(payload) < len(inner) * 0.6
    assert torch.equal(y, get_codec("int8").decode(inner, (128, 64), torch.float32))
    generator = torch.Generator().manual_seed(9)
    bits = torch.randint(-(2**31), 2**31 - 1, (64, 64), generator=generator, dtype=torch.int32)
    noise = bits.view(torch.float32)  # uniformly random bytes (some nan): incompressible
    raw_payload, y = _round_trip("zstd(3)", noise)
    assert raw_payload[0] == 0 and len(raw_payload) == 1 + 64 * 64 * 4  # stored raw, one byte over none
    assert torch.equal(y.view(torch.int32), bits)
    codec = get_codec("zstd(int8)")
    assert codec.variable_size
    assert codec.encoded_size((128, 64), torch.float32) == 1 + len(inner)


def test_zstd_rejects_lying_frames_before_decompressing() -> None:
    import zstandard

    codec = get_codec("zstd(int8)")
    shape = (32, 32)
    bomb = bytes([1]) + zstandard.ZstdCompressor().compress(bytes(10_000_000))
    assert len(bomb) <= codec.encoded_size(shape, torch.float32)  # small enough to pass the size check
    with pytest.raises(CodecError, match="frame declares 10000000 bytes"):
        codec.decode(bomb, shape, torch.float32)
    with pytest.raises(CodecError, match="not a zstd frame"):
        codec.decode(bytes([1]) + b"garbage!", shape, torch.float32)
    with pytest.raises(CodecError, match="unknown mode byte 7"):
        codec.decode(bytes([7, 0, 0]), shape, torch.float32)
    with pytest.raises(CodecError, match="at most"):
        codec.decode(bytes(2000), shape, torch.float32)
