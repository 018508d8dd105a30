"""The wire format against hostile or corrupted input: header-bound checksum, variable sizes, fuzzing.

Closes the known gap (a CRC over the payload only let a header edited from shape
[4,4] to [2,8], or float16 to bfloat16, decode silently wrong) and fuzzes every
new decoder: whatever the bytes, the outcome is a tensor of the declared shape
and dtype or a CodecError, never another exception.
"""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nebula_common.codec import CodecError, WireFormatError, decode_tensor, encode_tensor, get_codec
from nebula_common.codec.wire import header_checksum
from nebula_common.proto.nebula.v1 import tensor_pb2

pytestmark = pytest.mark.timeout(90)

FUZZ_SPECS = [
    "int8(scale=row)",
    "int8(block=5,scale=block)",
    "int8(rounding=stochastic)",
    "int4",
    "int4(block=3)",
    "topk(0.3)",
    "topk(0.02)",
    "fp16(topk(0.2))",
    "svd(0.5)",
    "fp16(svd(0.3))",
    "int8(lowrank(2))",
    "powersgd(2)",
    "zstd(int8)",
    "zstd(3)",
    "zstd(fp16(svd(0.4)))",
]


def _copy(header: tensor_pb2.TensorHeader) -> tensor_pb2.TensorHeader:
    out = tensor_pb2.TensorHeader()
    out.CopyFrom(header)
    return out


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("shape", [2, 8]),
        ("shape", [16]),
        ("dtype", "bfloat16"),
        ("codec", "bf16"),
        ("delta", True),
        ("raw_size", 64),
    ],
)
def test_editing_any_decode_relevant_header_field_is_detected(field: str, value: object) -> None:
    x = torch.randn(4, 4, dtype=torch.float16)
    encoded = encode_tensor(x, "fp16")
    header = _copy(encoded.header)
    if field == "shape":
        header.shape[:] = value  # type: ignore[index]
    else:
        setattr(header, field, value)
    if field == "raw_size":
        header.dtype = "float32"  # keep raw_size consistent so only the checksum can catch it
    with pytest.raises(WireFormatError, match="checksum"):
        decode_tensor(header, encoded.payload)


def test_routing_fields_are_not_covered_so_switches_may_rewrite_them() -> None:
    encoded = encode_tensor(torch.randn(3, 3), "int8", step=1, frame_id=9)
    header = _copy(encoded.header)
    header.frame_id, header.step, header.micro_batch = 10, 2, 1
    assert decode_tensor(header, encoded.payload).shape == (3, 3)


def test_legacy_payload_only_checksums_are_refused_by_name() -> None:
    encoded = encode_tensor(torch.randn(3, 3), "int8")
    header = _copy(encoded.header)
    header.checksum_version = 0
    with pytest.raises(WireFormatError, match="checksum_version: header has 0"):
        decode_tensor(header, encoded.payload)


def test_variable_size_payloads_are_bounded_not_exact() -> None:
    x = torch.zeros(32, 32)
    encoded = encode_tensor(x, "zstd(int8)")
    assert encoded.header.payload_size < get_codec("zstd(int8)").encoded_size((32, 32), torch.float32)
    assert torch.equal(decode_tensor(encoded.header, encoded.payload), x)
    header = _copy(encoded.header)
    header.payload_size = 1 + 4 + 1024 + 1
    with pytest.raises(WireFormatError, match="at most 1029"):
        decode_tensor(header, bytes(1030))


def test_stream_option_in_a_header_is_refused() -> None:
    encoded = encode_tensor(torch.randn(3), "int8")
    header = _copy(encoded.header)
    header.codec = "ef(int8)"
    with pytest.raises(WireFormatError, match="configures a stream"):
        decode_tensor(header, encoded.payload)


def test_transform_mode_byte_must_match_the_shape() -> None:
    x = torch.randn(64, 64)
    encoded = encode_tensor(x, "fp16(svd(0.1))")
    payload = bytes([1]) + encoded.payload[1:]
    header = _copy(encoded.header)
    header.checksum = header_checksum(header, payload)
    with pytest.raises(WireFormatError, match="dense fallback layout but shape"):
        decode_tensor(header, payload)


def test_corrupt_factors_are_refused_not_multiplied() -> None:
    x = torch.randn(64, 64)
    encoded = encode_tensor(x, "svd(0.1)")
    payload = bytearray(encoded.payload)
    payload[1:5] = bytes.fromhex("0000c07f")  # a float32 nan in U
    header = _copy(encoded.header)
    header.checksum = header_checksum(header, bytes(payload))
    with pytest.raises(WireFormatError, match="non-finite factor"):
        decode_tensor(header, bytes(payload))


@pytest.mark.parametrize(("spec", "code", "named"), [("int8", 0x80, "-128"), ("int4", 0x00, "-8")])
def test_a_code_outside_the_symmetric_range_is_refused(spec: str, code: int, named: str) -> None:
    """The encoders clip to [-127, 127] (int4: [-7, 7]); a peer's -128 (-8) is not ours."""
    encoded = encode_tensor(torch.randn(6, 4), spec)
    payload = bytearray(encoded.payload)
    payload[-1] = code  # the last code (int4: the last two)
    header = _copy(encoded.header)
    header.checksum = header_checksum(header, bytes(payload))
    with pytest.raises(WireFormatError, match=f"code {named}"):
        decode_tensor(header, bytes(payload))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.sampled_from(FUZZ_SPECS),
    shape=st.lists(st.integers(0, 9), min_size=0, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
    flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 255)), max_size=4),
    truncate=st.one_of(st.none(), st.integers(0, 64)),
    extend=st.binary(max_size=8),
)
def test_fuzz_new_codecs_through_the_wire(
    spec: str,
    shape: list[int],
    dtype: torch.dtype,
    flips: list[tuple[int, int]],
    truncate: int | None,
    extend: bytes,
) -> None:
    generator = torch.Generator().manual_seed(len(shape) * 31 + sum(shape))
    x = torch.randn(tuple(shape), generator=generator).to(dtype)
    encoded = encode_tensor(x, spec)
    payload = bytearray(encoded.payload)
    for position, xor in flips:
        if payload:
            payload[position % len(payload)] ^= xor
    data = bytes(payload[: len(payload) - truncate] if truncate is not None else payload) + extend
    header = _copy(encoded.header)
    header.payload_size = len(data)
    header.checksum = header_checksum(header, data)  # past the CRC: the codec's own checks must hold
    try:
        y = decode_tensor(header, data)
    except CodecError:
        return
    assert tuple(y.shape) == tuple(shape) and y.dtype == dtype


@pytest.mark.parametrize(
    ("spec", "dtype", "scale"),
    [
        ("int8", torch.float32, 3e38),
        ("int4", torch.float32, 3e38),
        ("int8(scale=row)", torch.float16, 1000.0),
        ("int4(block=3)", torch.bfloat16, 1e38),
    ],
)
def test_a_scale_that_overflows_the_dtype_is_refused(spec: str, dtype: torch.dtype, scale: float) -> None:
    """A peer's finite scale times the largest code beyond the dtype's range would hand the model inf."""
    encoded = encode_tensor(torch.randn(6, 4).to(dtype), spec)
    payload = bytearray(encoded.payload)
    payload[0:4] = struct.pack("<f", scale)  # the first (or only) scale; its group holds a code of +-qmax
    header = _copy(encoded.header)
    header.checksum = header_checksum(header, bytes(payload))
    with pytest.raises(WireFormatError, match="overflow"):
        decode_tensor(header, bytes(payload))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec", ["int8", "int8(scale=row)", "int8(error=0.05)", "int4", "int4(block=3)"])
def test_values_at_the_top_of_the_dtype_s_range_decode_finite(spec: str, dtype: torch.dtype) -> None:
    """absmax / qmax rounded up to float32 would decode the largest value to inf; the encoder caps it."""
    top = torch.finfo(dtype).max
    x = torch.tensor([[top, -top], [1.0, 0.5]], dtype=dtype)
    encoded = encode_tensor(x, spec)
    y = decode_tensor(encoded.header, encoded.payload)
    assert bool(torch.isfinite(y).all()), y
    assert float(y[0, 0]) == pytest.approx(top, rel=1e-6)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # an overflow is refused, never computed and warned
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.sampled_from(FUZZ_SPECS),
    shape=st.lists(st.integers(0, 12), min_size=1, max_size=3),
    data=st.data(),
)
def test_fuzz_decoders_with_arbitrary_bytes_of_an_acceptable_length(
    spec: str, shape: list[int], data: st.DataObject
) -> None:
    codec = get_codec(spec)
    bound = codec.encoded_size(tuple(shape), torch.float32)
    length = data.draw(st.integers(0, bound)) if codec.variable_size else bound
    payload = data.draw(st.binary(min_size=length, max_size=length))
    try:
        y = codec.decode(payload, tuple(shape), torch.float32)
    except CodecError:
        return
    assert tuple(y.shape) == tuple(shape)
