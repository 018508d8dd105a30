"""Codec library: codecs, spec parsing, the wire format and frame reassembly.

These pin the properties the WAN path relies on: exact payload sizes, documented
error bounds, and that malformed input of any kind ends as a CodecError /
WireFormatError naming the problem rather than a crash or a wrong tensor.
"""

from __future__ import annotations

import math
import re
import struct
import zlib
from collections.abc import Callable, Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nebula_common.codec import (
    Codec,
    CodecError,
    EncodedTensor,
    FrameAssembler,
    WireFormatError,
    available_codecs,
    decode_tensor,
    encode_tensor,
    get_codec,
    parse_direction_pair,
    register_codec,
    to_frames,
)
from nebula_common.codec.wire import header_checksum
from nebula_common.proto.nebula.v1 import tensor_pb2

pytestmark = pytest.mark.timeout(60)

BUILTIN_CODECS = ["none", "fp16", "bf16", "int8"]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SHAPES: list[tuple[int, ...]] = [(), (0,), (7,), (3, 4), (2, 0, 3), (2, 3, 4, 5)]


def _make(shape: Sequence[int], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float64).to(dtype)


def _check_close(codec: str, original: torch.Tensor, decoded: torch.Tensor, payload: bytes) -> None:
    """Per-codec accuracy contract, in float64 so the check itself adds no error."""
    x, y = original.double(), decoded.double()
    if codec == "none":
        assert torch.equal(original, decoded)
    elif codec == "fp16":
        # Relative 2^-11 for normal fp16 values, plus an absolute floor for fp16 subnormals
        # and the extra rounding when the original dtype is bfloat16.
        tolerance = (1e-3 if original.dtype != torch.bfloat16 else 1e-2) * x.abs() + 6e-8
        assert bool(((x - y).abs() <= tolerance).all())
    elif codec == "bf16":
        assert bool(((x - y).abs() <= 1e-2 * x.abs()).all())
    elif codec == "int8":
        (scale,) = struct.unpack("<f", payload[:4])
        absmax = float(x.abs().amax()) if x.numel() else 0.0
        # Rounding to the grid costs scale/2; float32 arithmetic adds ~2^-24 * absmax, and
        # decoding back into a half dtype adds that dtype's rounding.
        slack = 1e-6 * absmax if original.dtype in (torch.float32, torch.float64) else 1e-2 * absmax
        error = float((x - y).abs().amax()) if x.numel() else 0.0
        assert error <= scale / 2 + slack


# --- codecs -----------------------------------------------------------------------------------------


def test_builtin_codecs_are_registered() -> None:
    assert set(BUILTIN_CODECS) <= set(available_codecs())
    assert available_codecs() == sorted(available_codecs())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", BUILTIN_CODECS)
def test_round_trip_every_codec_dtype_and_shape(
    spec: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    codec = get_codec(spec)
    tensor = _make(shape, dtype)
    payload = codec.encode(tensor)
    assert isinstance(payload, bytes)
    assert len(payload) == codec.encoded_size(shape, dtype)
    decoded = codec.decode(payload, shape, dtype)
    assert decoded.dtype == dtype
    assert tuple(decoded.shape) == shape
    _check_close(spec, tensor, decoded, payload)


@pytest.mark.parametrize("spec", BUILTIN_CODECS)
@pytest.mark.parametrize(
    "view",
    [
        lambda t: t.t(),
        lambda t: t[:, ::3],
        lambda t: t[1:, 2:].transpose(0, 1),
        lambda t: t.expand(3, -1, -1)[:, 0],
    ],
    ids=["transpose", "stride", "slice_transpose", "expand"],
)
def test_non_contiguous_inputs(spec: str, view: Callable[[torch.Tensor], torch.Tensor]) -> None:
    codec = get_codec(spec)
    tensor = view(_make((6, 9), torch.float32))
    assert not tensor.is_contiguous()
    payload = codec.encode(tensor)
    decoded = codec.decode(payload, tuple(tensor.shape), tensor.dtype)
    assert decoded.is_contiguous()
    _check_close(spec, tensor, decoded, payload)


@pytest.mark.parametrize(
    ("spec", "dtype", "bytes_per_element", "overhead"),
    [
        ("none", torch.float32, 4, 0),
        ("none", torch.float64, 8, 0),
        ("none", torch.bfloat16, 2, 0),
        ("fp16", torch.float32, 2, 0),
        ("fp16", torch.float64, 2, 0),
        ("bf16", torch.float32, 2, 0),
        ("int8", torch.float32, 1, 4),
        ("int8", torch.float16, 1, 4),
    ],
)
def test_encoded_size_is_exact(spec: str, dtype: torch.dtype, bytes_per_element: int, overhead: int) -> None:
    codec = get_codec(spec)
    for shape in [(), (0,), (1000,), (3, 5, 7)]:
        n = math.prod(shape)
        assert codec.encoded_size(shape, dtype) == n * bytes_per_element + overhead
        assert len(codec.encode(_make(shape, dtype))) == n * bytes_per_element + overhead


def test_none_is_raw_little_endian_bytes() -> None:
    tensor = torch.tensor([1.0, -2.5, 3.25], dtype=torch.float32)
    assert get_codec("none").encode(tensor) == struct.pack("<3f", 1.0, -2.5, 3.25)


def test_fp16_error_bound_on_standard_normal() -> None:
    x = _make((100_000,), torch.float32, seed=1)
    y = get_codec("fp16").decode(get_codec("fp16").encode(x), (100_000,), torch.float32)
    rel = (x - y).abs() / x.abs().clamp_min(6.2e-5)  # below fp16's normal range the error is absolute
    assert float(rel.max()) <= 1e-3


def test_bf16_error_bound_on_standard_normal() -> None:
    x = _make((100_000,), torch.float32, seed=2)
    y = get_codec("bf16").decode(get_codec("bf16").encode(x), (100_000,), torch.float32)
    assert float(((x - y).abs() / x.abs()).max()) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_int8_error_bound_and_layout(dtype: torch.dtype) -> None:
    x = _make((10_000,), dtype, seed=3) * 7
    payload = get_codec("int8").encode(x)
    (scale,) = struct.unpack("<f", payload[:4])
    absmax = float(x.abs().max())
    assert scale == pytest.approx(absmax / 127, rel=1e-6)
    values = torch.frombuffer(bytearray(payload[4:]), dtype=torch.int8)
    assert int(values.abs().max()) == 127
    assert int(values.min()) >= -127
    y = get_codec("int8").decode(payload, (10_000,), dtype)
    assert float((x - y).abs().max()) <= scale / 2 + 1e-6 * absmax


def test_int8_all_zero_tensor_has_zero_scale() -> None:
    payload = get_codec("int8").encode(torch.zeros(5, 3))
    assert payload == struct.pack("<f", 0.0) + bytes(15)
    assert torch.equal(get_codec("int8").decode(payload, (5, 3), torch.float32), torch.zeros(5, 3))


def test_int8_tiny_and_huge_magnitudes() -> None:
    tiny = torch.tensor([1e-44, -3e-45, 0.0])  # scale underflows float32
    payload = get_codec("int8").encode(tiny)
    (scale,) = struct.unpack("<f", payload[:4])
    assert scale > 0
    decoded = get_codec("int8").decode(payload, (3,), torch.float32)
    assert float((decoded.double() - tiny.double()).abs().max()) <= scale / 2
    with pytest.raises(CodecError, match="overflows float32"):
        get_codec("int8").encode(torch.tensor([1e300], dtype=torch.float64))


@pytest.mark.parametrize(
    ("value", "word"), [(math.nan, "nan"), (math.inf, "inf"), (-math.inf, "inf")], ids=["nan", "inf", "-inf"]
)
def test_int8_rejects_non_finite(value: float, word: str) -> None:
    tensor = torch.ones(10)
    tensor[3] = value
    with pytest.raises(CodecError, match=word):
        get_codec("int8").encode(tensor)


def test_int8_rejects_corrupt_scale() -> None:
    payload = struct.pack("<f", math.nan) + bytes(4)
    with pytest.raises(CodecError, match="scale"):
        get_codec("int8").decode(payload, (4,), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_fp16_saturates_instead_of_overflowing(dtype: torch.dtype) -> None:
    x = torch.tensor([7e4, -1e5, 65519.0, 65520.0, 1e30, 1.5], dtype=dtype)
    y = get_codec("fp16").decode(get_codec("fp16").encode(x), (6,), torch.float32)
    assert torch.equal(y, torch.tensor([65504.0, -65504.0, 65504.0, 65504.0, 65504.0, 1.5]))


def test_half_codecs_pass_existing_non_finite_values_through() -> None:
    x = torch.tensor([math.inf, -math.inf, math.nan, 1.0])
    for spec in ("fp16", "bf16"):
        y = get_codec(spec).decode(get_codec(spec).encode(x), (4,), torch.float32)
        assert y[0] == math.inf and y[1] == -math.inf and math.isnan(y[2]) and y[3] == 1.0


def test_bf16_saturates_float64_beyond_its_range() -> None:
    x = torch.tensor([1e39, -1e300], dtype=torch.float64)
    y = get_codec("bf16").decode(get_codec("bf16").encode(x), (2,), torch.float64)
    assert bool(torch.isfinite(y).all())
    assert float(y[0]) == pytest.approx(torch.finfo(torch.bfloat16).max)


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (torch.arange(4), "unsupported dtype"),
        (torch.ones(3, dtype=torch.complex64), "unsupported dtype"),
        (torch.ones(3).to_sparse(), "dense"),
        ([1.0, 2.0], "torch.Tensor"),
    ],
    ids=["int64", "complex", "sparse", "list"],
)
def test_encode_rejects_unsupported_input(tensor: object, message: str) -> None:
    for spec in BUILTIN_CODECS:
        with pytest.raises(CodecError, match=message):
            get_codec(spec).encode(tensor)  # type: ignore[arg-type]


def test_encode_accepts_tensors_requiring_grad() -> None:
    x = torch.randn(4, requires_grad=True)
    y = get_codec("none").decode(get_codec("none").encode(x), (4,), torch.float32)
    assert torch.equal(y, x.detach())


@pytest.mark.parametrize("spec", BUILTIN_CODECS)
def test_decode_rejects_wrong_payload_length(spec: str) -> None:
    codec = get_codec(spec)
    payload = codec.encode(torch.ones(8))
    for bad in (payload[:-1], payload + b"\x00", b""):
        with pytest.raises(CodecError, match="bytes"):
            codec.decode(bad, (8,), torch.float32)
    with pytest.raises(CodecError, match="negative"):
        codec.decode(payload, (-8,), torch.float32)
    with pytest.raises(CodecError, match="unsupported dtype"):
        codec.decode(payload, (8,), torch.int32)


# --- spec parsing and registry ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "canonical"),
    [("none", "none"), ("FP16", "fp16"), ("  fp16\t", "fp16"), ("Bf16", "bf16"), ("\nINT8 ", "int8")],
)
def test_spec_is_case_and_whitespace_insensitive(text: str, canonical: str) -> None:
    assert get_codec(text).spec == canonical


def test_unknown_codec_lists_known_ones() -> None:
    with pytest.raises(CodecError, match="unknown codec 'lz4'") as info:
        get_codec("lz4")
    for name in BUILTIN_CODECS:
        assert name in str(info.value)


@pytest.mark.parametrize("text", ["none(0.5)", "NONE( 0.5 )", "none(int8)", "none(svd(0.6))"])
def test_arguments_to_argumentless_codec_are_rejected(text: str) -> None:
    with pytest.raises(CodecError, match=r"none takes no arguments"):
        get_codec(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("fp16(0.5)", "fp16's argument must be a low-rank or top-k codec spec"),
        ("FP16( 0.5 )", "fp16's argument must be"),
        ("fp16(int8)", "fp16 can only wrap a low-rank or top-k codec"),
        ("int8(1, 2)", "int8 takes arguments"),
        ("int8(1)", "int8's argument must be"),
        ("int8(bogus=1)", "int8 has no option 'bogus'"),
        ("int8(scale=diagonal)", "scale must be one of tensor, row, block"),
    ],
)
def test_bad_arguments_to_leaf_codecs_are_named(text: str, message: str) -> None:
    with pytest.raises(CodecError, match=re.escape(message)):
        get_codec(text)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "fp16(",
        "fp16)",
        "fp16()",
        "fp16 int8",
        "fp16,",
        "(fp16)",
        "1",
        "fp-16",
        "fp16((1))",
        "x" * 300,
    ],
)
def test_malformed_specs_are_rejected(text: str) -> None:
    with pytest.raises(CodecError):
        get_codec(text)


def test_deep_nesting_is_bounded() -> None:
    with pytest.raises(CodecError, match="nesting"):
        get_codec("a(" * 50 + ")" * 50)


def test_direction_pair() -> None:
    assert parse_direction_pair("FP16+INT8") == ("fp16", "int8")
    assert parse_direction_pair(" bf16 + none ") == ("bf16", "none")
    assert parse_direction_pair("int8") == ("int8", "int8")
    with pytest.raises(CodecError, match="FORWARD\\+BACKWARD"):
        parse_direction_pair("fp16+int8+bf16")
    with pytest.raises(CodecError, match="backward codec"):
        parse_direction_pair("fp16+int3")
    with pytest.raises(CodecError, match="forward codec"):
        parse_direction_pair("+int8")


class _ScaledCodec(Codec):
    """Test plug-in taking a nested codec and a number: stores ``inner(x * factor)``."""

    def __init__(self, inner: Codec, factor: float) -> None:
        if not isinstance(inner, Codec) or not isinstance(factor, int | float) or factor == 0:
            raise CodecError("test_scaled takes (codec, non-zero number)")
        self.inner = inner
        self.factor = factor
        self.spec = f"test_scaled({inner.spec},{factor!r})"

    def encoded_size(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return self.inner.encoded_size(shape, dtype)

    def _encode(self, tensor: torch.Tensor) -> bytes:
        return self.inner.encode(tensor * self.factor)

    def _decode(self, payload: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.inner.decode(payload, shape, dtype) / self.factor


@pytest.fixture(scope="module")
def scaled_codec() -> None:
    register_codec("test_scaled", _ScaledCodec, replace=True)


@pytest.mark.usefixtures("scaled_codec")
def test_plugin_with_nested_spec_and_number() -> None:
    codec = get_codec(" TEST_SCALED( FP16 , 2.50 ) ")
    assert codec.spec == "test_scaled(fp16,2.5)"
    assert get_codec(codec.spec) is codec  # canonical specs re-parse to the cached codec
    assert isinstance(codec, _ScaledCodec) and codec.inner.spec == "fp16"
    x = torch.randn(100)
    y = codec.decode(codec.encode(x), (100,), torch.float32)
    assert float((x - y).abs().max()) < 1e-2
    assert get_codec("test_scaled(int8,2)").spec == "test_scaled(int8,2)"
    assert get_codec("test_scaled(none,1e-3)").spec == "test_scaled(none,0.001)"
    with pytest.raises(CodecError, match=r"test_scaled takes arguments \(inner, factor\), got 1"):
        get_codec("test_scaled(fp16)")
    with pytest.raises(CodecError, match="non-zero"):
        get_codec("test_scaled(fp16,0)")


def test_register_rejects_duplicates_and_bad_names() -> None:
    with pytest.raises(CodecError, match="already registered"):
        register_codec("fp16", _ScaledCodec)
    for name in ("FP16", "my codec", "", "1abc"):
        with pytest.raises(CodecError, match="identifier"):
            register_codec(name, _ScaledCodec)


def test_factory_must_report_canonical_spec() -> None:
    class _Liar(Codec):
        spec = "something_else"

        def encoded_size(self, shape: Sequence[int], dtype: torch.dtype) -> int:
            return 0

        def _encode(self, tensor: torch.Tensor) -> bytes:
            return b""

        def _decode(self, payload: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype)

    register_codec("test_liar", _Liar, replace=True)
    with pytest.raises(CodecError, match="reports spec"):
        get_codec("test_liar")


# --- wire format ------------------------------------------------------------------------------------


def test_encode_tensor_fills_header() -> None:
    x = _make((3, 5), torch.float32)
    encoded = encode_tensor(
        x,
        " FP16 ",
        job_id="job-1",
        edge="encoder->decoder",
        direction=tensor_pb2.DIRECTION_BACKWARD,
        step=7,
        micro_batch=2,
        frame_id=42,
    )
    h = encoded.header
    assert (h.dtype, list(h.shape), h.codec) == ("float32", [3, 5], "fp16")
    assert h.payload_size == len(encoded.payload) == 30
    # The documented checksum_version 1 layout (tensor.proto), rebuilt independently here.
    meta = (
        b"nebula.v1.TensorHeader/crc1\0float32\0fp16\0"
        + struct.pack("<Qqq", 2, 3, 5)
        + struct.pack("<QQ", 30, 60)
        + b"\0"
        + struct.pack("<Q", 0)
    )
    assert h.checksum_version == 1 and not h.delta
    assert h.checksum == zlib.crc32(meta + encoded.payload)
    assert h.raw_size == 60
    assert (h.job_id, h.edge, h.direction, h.step, h.micro_batch, h.frame_id) == (
        "job-1",
        "encoder->decoder",
        tensor_pb2.DIRECTION_BACKWARD,
        7,
        2,
        42,
    )
    with pytest.raises(TypeError, match="checksum"):
        encode_tensor(x, "fp16", checksum=1)


@pytest.mark.parametrize("spec", BUILTIN_CODECS)
@pytest.mark.parametrize("shape", [(), (0,), (4, 6)], ids=str)
def test_wire_round_trip(spec: str, shape: tuple[int, ...]) -> None:
    x = _make(shape, torch.bfloat16)
    encoded = encode_tensor(x, spec)
    y = decode_tensor(encoded.header, encoded.payload)
    assert y.dtype == torch.bfloat16 and tuple(y.shape) == shape
    _check_close(spec, x, y, encoded.payload)


def _corrupt(field: str) -> tuple[tensor_pb2.TensorHeader, bytes]:
    encoded = encode_tensor(_make((4, 4), torch.float32), "int8")
    header = tensor_pb2.TensorHeader()
    header.CopyFrom(encoded.header)
    payload = encoded.payload
    if field == "checksum":
        header.checksum ^= 1
    elif field == "payload":
        payload = payload[:-1] + bytes([payload[-1] ^ 0xFF])
    elif field == "payload_size":
        header.payload_size += 1
    elif field == "truncated":
        payload = payload[:-1]
    elif field == "shape_negative":
        header.shape[:] = [-4, -4]
    elif field == "shape_mismatch":
        header.shape[:] = [4, 5]
    elif field == "shape_huge":
        header.shape[:] = [1 << 40, 1 << 40]
    elif field == "shape_dims":
        header.shape[:] = [1] * 40
    elif field == "dtype":
        header.dtype = "int7"
    elif field == "dtype_empty":
        header.dtype = ""
    elif field == "codec":
        header.codec = "lz4"
    elif field == "codec_args":
        header.codec = "int8(3)"
    elif field == "codec_size":
        header.codec = "fp16"
    elif field == "raw_size":
        header.raw_size = 12
    return header, payload


@pytest.mark.parametrize(
    ("field", "named"),
    [
        ("checksum", "checksum"),
        ("payload", "checksum"),
        ("payload_size", "payload_size"),
        ("truncated", "payload_size"),
        ("shape_negative", "shape"),
        ("shape_mismatch", "shape"),
        ("shape_huge", "shape"),
        ("shape_dims", "shape"),
        ("dtype", "dtype"),
        ("dtype_empty", "dtype"),
        ("codec", "codec"),
        ("codec_args", "codec"),
        ("codec_size", "codec"),
        ("raw_size", "raw_size"),
    ],
)
def test_decode_tensor_names_the_corrupted_field(field: str, named: str) -> None:
    header, payload = _corrupt(field)
    with pytest.raises(WireFormatError, match=named):
        decode_tensor(header, payload)


def test_decode_tensor_rejects_bad_payload_with_valid_checksum() -> None:
    encoded = encode_tensor(torch.ones(4), "int8")
    payload = struct.pack("<f", -1.0) + encoded.payload[4:]
    encoded.header.checksum = header_checksum(encoded.header, payload)
    with pytest.raises(WireFormatError, match=r"payload: .*scale"):
        decode_tensor(encoded.header, payload)


def test_wire_errors_are_codec_errors() -> None:
    assert issubclass(WireFormatError, CodecError)
    assert issubclass(CodecError, ValueError)


# --- framing ----------------------------------------------------------------------------------------


def _frames(encoded: EncodedTensor, chunk_size: int = 256 * 1024) -> list[tensor_pb2.TensorFrame]:
    return list(to_frames(encoded, chunk_size))


def test_to_frames_layout() -> None:
    encoded = encode_tensor(torch.randn(2500), "none", frame_id=9)  # 10,000 bytes
    frames = _frames(encoded, 4096)
    assert frames[0].WhichOneof("part") == "header"
    assert frames[0].header == encoded.header
    chunks = [f.chunk for f in frames[1:]]
    assert [c.offset for c in chunks] == [0, 4096, 8192]
    assert [len(c.data) for c in chunks] == [4096, 4096, 1808]
    assert [c.last for c in chunks] == [False, False, True]
    assert all(c.frame_id == 9 for c in chunks)
    assert b"".join(c.data for c in chunks) == encoded.payload
    with pytest.raises(ValueError, match="chunk_size"):
        _frames(encoded, 0)


def test_empty_payload_gets_one_empty_last_chunk() -> None:
    encoded = EncodedTensor(header=tensor_pb2.TensorHeader(frame_id=3), payload=b"")
    frames = _frames(encoded)
    assert len(frames) == 2
    assert frames[1].chunk == tensor_pb2.TensorChunk(frame_id=3, offset=0, data=b"", last=True)
    assembler = FrameAssembler()
    assert assembler.feed(frames[0]) is None
    done = assembler.feed(frames[1])
    assert done is not None and done.payload == b""


def test_megabyte_tensor_round_trips_through_256k_frames() -> None:
    x = _make((512, 512), torch.float32, seed=4)  # 1 MiB of float32
    assembler = FrameAssembler()
    for frame_id, spec in enumerate(["none", "fp16", "int8"]):
        encoded = encode_tensor(x, spec, frame_id=frame_id, job_id="j")
        frames = _frames(encoded)
        assert len(frames) == 1 + math.ceil(len(encoded.payload) / (256 * 1024))
        results = [assembler.feed(frame) for frame in frames]
        assert results[:-1] == [None] * (len(frames) - 1)
        done = results[-1]
        assert done is not None and not assembler.in_progress
        assert done.header == encoded.header and done.payload == encoded.payload
        y = decode_tensor(done.header, done.payload)
        _check_close(spec, x, y, done.payload)


def _sample_frames() -> list[tensor_pb2.TensorFrame]:
    return _frames(encode_tensor(torch.randn(3000), "none", frame_id=5), 4096)  # header + 3 chunks


def test_assembler_rejects_reordered_chunks() -> None:
    frames = _sample_frames()
    assembler = FrameAssembler()
    assembler.feed(frames[0])
    with pytest.raises(WireFormatError, match="offset"):
        assembler.feed(frames[2])


def test_assembler_rejects_missing_chunk() -> None:
    frames = _sample_frames()
    assembler = FrameAssembler()
    for frame in (frames[0], frames[1]):
        assembler.feed(frame)
    with pytest.raises(WireFormatError, match="offset"):
        assembler.feed(frames[3])


def test_assembler_rejects_chunk_without_header() -> None:
    with pytest.raises(WireFormatError, match="without a header"):
        FrameAssembler().feed(_sample_frames()[1])


def test_assembler_rejects_oversize_payload() -> None:
    frames = _sample_frames()
    frames[3].chunk.data += b"extra"
    assembler = FrameAssembler()
    for frame in frames[:3]:
        assembler.feed(frame)
    with pytest.raises(WireFormatError, match="more than"):
        assembler.feed(frames[3])


def test_assembler_rejects_short_last_chunk() -> None:
    frames = _sample_frames()
    frames[2].chunk.last = True
    assembler = FrameAssembler()
    for frame in frames[:2]:
        assembler.feed(frame)
    with pytest.raises(WireFormatError, match="last chunk"):
        assembler.feed(frames[2])


def test_assembler_rejects_foreign_frame_id_and_interleaved_header() -> None:
    frames = _sample_frames()
    assembler = FrameAssembler()
    assembler.feed(frames[0])
    frames[1].chunk.frame_id = 6
    with pytest.raises(WireFormatError, match="frame_id"):
        assembler.feed(frames[1])
    assembler.feed(frames[0])
    with pytest.raises(WireFormatError, match="incomplete"):
        assembler.feed(frames[0])


def test_assembler_rejects_empty_frame_and_absurd_size() -> None:
    with pytest.raises(WireFormatError, match="neither"):
        FrameAssembler().feed(tensor_pb2.TensorFrame())
    huge = tensor_pb2.TensorFrame(header=tensor_pb2.TensorHeader(payload_size=2**63))
    with pytest.raises(WireFormatError, match="payload_size"):
        FrameAssembler().feed(huge)


def test_assembler_recovers_after_error() -> None:
    frames = _sample_frames()
    assembler = FrameAssembler()
    assembler.feed(frames[0])
    with pytest.raises(WireFormatError):
        assembler.feed(frames[2])
    assert not assembler.in_progress
    results = [assembler.feed(frame) for frame in frames]
    assert results[-1] is not None


# --- fuzzing ----------------------------------------------------------------------------------------

_UTF8_TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=24)
_SPECS = st.one_of(
    st.sampled_from([*BUILTIN_CODECS, "FP16", "int8(1)", "zstd", "", "fp16(", "ef(int8)", "auto", "int4"]),
    _UTF8_TEXT,
)
_DTYPE_NAMES = st.one_of(
    st.sampled_from(["float32", "float64", "float16", "bfloat16", "int8", ""]), _UTF8_TEXT
)
_UINT64 = st.integers(0, 2**64 - 1)
_SHAPES = st.lists(st.one_of(st.integers(-3, 40), st.integers(-(2**63), 2**63 - 1)), max_size=6)

_HEADER_MUTATIONS = st.fixed_dictionaries(
    {},
    optional={
        "dtype": _DTYPE_NAMES,
        "shape": _SHAPES,
        "codec": _SPECS,
        "payload_size": st.one_of(st.integers(0, 2048), _UINT64),
        "checksum": st.integers(0, 2**32 - 1),
        "raw_size": st.one_of(st.integers(0, 2048), _UINT64),
    },
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.sampled_from(BUILTIN_CODECS),
    shape=st.lists(st.integers(0, 5), max_size=3),
    mutations=_HEADER_MUTATIONS,
    payload=st.one_of(st.none(), st.binary(max_size=300)),
    flip=st.one_of(st.none(), st.integers(0, 10_000)),
    fix_checksum=st.booleans(),
)
def test_fuzz_decode_tensor_only_raises_codec_errors(
    spec: str,
    shape: list[int],
    mutations: dict[str, object],
    payload: bytes | None,
    flip: int | None,
    fix_checksum: bool,
) -> None:
    encoded = encode_tensor(torch.randn(shape), spec)
    header = encoded.header
    for name, value in mutations.items():
        if name == "shape":
            header.shape[:] = value  # type: ignore[index]
        else:
            setattr(header, name, value)
    data = encoded.payload if payload is None else payload
    if flip is not None and data:
        index = flip % len(data)
        data = data[:index] + bytes([data[index] ^ 0x5A]) + data[index + 1 :]
    if fix_checksum:  # get past the CRC so the codec's own payload checks are exercised too
        header.checksum = header_checksum(header, data)
    try:
        tensor = decode_tensor(header, data)
    except CodecError:
        return
    assert tuple(tensor.shape) == tuple(header.shape)
    assert tensor.dtype == {"float32": torch.float32, "float64": torch.float64}.get(
        header.dtype, tensor.dtype
    )


_CHUNKS = st.builds(
    tensor_pb2.TensorChunk,
    frame_id=st.integers(0, 3),
    offset=st.one_of(st.integers(0, 64), _UINT64),
    data=st.binary(max_size=32),
    last=st.booleans(),
)
_HEADERS = st.builds(
    tensor_pb2.TensorHeader,
    frame_id=st.integers(0, 3),
    payload_size=st.one_of(st.integers(0, 64), _UINT64),
    codec=_SPECS,
)
_FRAMES = st.one_of(
    st.builds(tensor_pb2.TensorFrame, header=_HEADERS),
    st.builds(tensor_pb2.TensorFrame, chunk=_CHUNKS),
    st.just(tensor_pb2.TensorFrame()),
)


@settings(max_examples=300, deadline=None)
@given(frames=st.lists(_FRAMES, max_size=12))
def test_fuzz_frame_assembler_only_raises_wire_errors(frames: list[tensor_pb2.TensorFrame]) -> None:
    assembler = FrameAssembler()
    for frame in frames:
        try:
            done = assembler.feed(frame)
        except WireFormatError:
            assert not assembler.in_progress
            continue
        if done is not None:
            assert len(done.payload) == done.header.payload_size
            assert not assembler.in_progress
