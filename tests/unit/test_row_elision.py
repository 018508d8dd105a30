"""Zero rows (padding) are left out of the payload, put back as zeros, and a forged bitmap is refused."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nebula_common.codec.row_elision import zero_rows
from nebula_common.codec.stream import TensorStreamDecoder, TensorStreamEncoder
from nebula_common.codec.wire_header import WireFormatError, header_checksum
from nebula_common.codec.wire_tensor import decode_tensor, encode_tensor
from nebula_common.proto.nebula.v1 import tensor_pb2
from nebula_common.zoo.adapters import memory_padding


def _padded(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A batch of 4 sentences of 12 positions, d = 16, with 3, 12, 0 and 7 real positions."""
    x = torch.randn(4, 12, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    for sentence, real in enumerate((3, 12, 0, 7)):
        x[sentence, real:] = 0
    x[0, 3:] = -0.0  # what `h * ~padding` gives a negative state: -0.0 is zero too
    return x


def _roundtrip(spec: str, x: torch.Tensor) -> tuple[tensor_pb2.TensorHeader, torch.Tensor]:
    encoded = TensorStreamEncoder(spec).encode(x, step=0)
    return encoded.header, TensorStreamDecoder(spec).decode(encoded.header, bytes(encoded.payload))


def test_codec_none_sends_only_the_real_rows_and_gives_back_the_same_tensor() -> None:
    x = _padded()
    header, y = _roundtrip("none", x)
    real = 3 + 12 + 0 + 7
    assert header.payload_size == real * 16 * 4
    assert header.raw_size == x.numel() * 4 and list(header.shape) == [4, 12, 16]
    assert len(header.present_rows) == 6  # 48 rows, one bit each
    assert torch.equal(y, x) and y.dtype == x.dtype


@pytest.mark.parametrize("spec", ["fp16", "bf16", "int8", "zstd(int8)", "topk(0.25)", "fp16(svd(0.5))"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_codec_sees_only_the_real_rows_and_the_padding_comes_back_exactly_zero(
    spec: str, dtype: torch.dtype
) -> None:
    x = _padded(dtype)
    whole = TensorStreamEncoder(spec).encode(x.reshape(-1, 16)[x.reshape(-1, 16).ne(0).any(-1)], step=0)
    header, y = _roundtrip(spec, x)
    assert header.present_rows and header.payload_size == whole.header.payload_size
    assert y.shape == x.shape and y.dtype == dtype
    padding = x.ne(0).any(-1).logical_not()
    assert bool((y[padding] == 0).all())
    # What the decoder of ABNet reads as padding is still exactly the padding.
    assert torch.equal(memory_padding(y)[[0, 1, 3]], memory_padding(x)[[0, 1, 3]])


def test_a_tensor_without_zero_rows_goes_exactly_as_before() -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    encoded = TensorStreamEncoder("int8").encode(x, step=0, frame_id=3)
    plain = encode_tensor(x, "int8", step=0, frame_id=3)
    assert encoded.header == plain.header and bytes(encoded.payload) == bytes(plain.payload)
    assert not encoded.header.present_rows
    # A map must pay for itself: one zero among 200 one-element rows saves 4 bytes, the map costs 25.
    thin = torch.ones(200, 1)
    thin[5] = 0
    assert not TensorStreamEncoder("none").encode(thin, step=0).header.present_rows


def test_an_all_zero_tensor_sends_one_row() -> None:
    header, y = _roundtrip("int8", torch.zeros(6, 32))
    assert header.present_rows == bytes([1])  # row 0 only
    assert torch.equal(y, torch.zeros(6, 32))


def test_error_feedback_drops_the_residual_of_a_row_left_out() -> None:
    encoder, decoder = TensorStreamEncoder("ef(int8)"), TensorStreamDecoder("ef(int8)")
    first = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2))
    encoder.encode(first, step=0)  # every row real: a residual everywhere
    second = first.clone()
    second[:, 3:] = 0  # now padding there
    encoded = encoder.encode(second, step=1)
    y = decoder.decode(encoded.header, bytes(encoded.payload))
    assert encoded.header.present_rows and bool((y[:, 3:] == 0).all())
    (residual,) = encoder._residuals.values()
    assert bool((residual[:, 3:] == 0).all()) and bool(residual[:, :3].ne(0).any())


def _frame(x: torch.Tensor) -> tuple[tensor_pb2.TensorHeader, bytes]:
    encoded = TensorStreamEncoder("none").encode(x, step=0)
    return encoded.header, bytes(encoded.payload)


def _resealed(header: tensor_pb2.TensorHeader, payload: bytes) -> tensor_pb2.TensorHeader:
    """A forger who also recomputes the CRC: the checks behind the checksum must still hold."""
    header.checksum = header_checksum(header, payload)
    return header


def test_a_flipped_bit_in_the_map_fails_the_checksum() -> None:
    header, payload = _frame(_padded())
    bits = bytearray(header.present_rows)
    assert bits[0] & 0b1111 == 0b0111  # sentence 0: positions 0-2 real, 3 padding
    bits[0] ^= 0b1001  # position 0's row moved to position 3: as many rows as the payload holds
    header.present_rows = bytes(bits)
    with pytest.raises(WireFormatError, match=r"^checksum: CRC-32 of header fields and payload"):
        decode_tensor(header, payload)


def _longer(header: tensor_pb2.TensorHeader) -> None:
    header.present_rows += b"\0"


def _shorter(header: tensor_pb2.TensorHeader) -> None:
    header.present_rows = header.present_rows[:-1]


def _more_rows(header: tensor_pb2.TensorHeader) -> None:
    header.present_rows = b"\xff" * 6  # claims all 48 rows for a payload of 22


def _flat(header: tensor_pb2.TensorHeader) -> None:
    del header.shape[:]
    header.shape.append(768)  # the same elements as one row: nothing to leave out


@pytest.mark.parametrize(
    ("forge", "message"),
    [
        (_longer, "present_rows: 7 bytes, but shape"),
        (_shorter, "present_rows: 5 bytes, but shape"),
        (_more_rows, "payload_size: header says 1408 bytes but codec none encodes shape \\[48, 16\\]"),
        (_flat, "present_rows: set on shape \\[768\\]"),
    ],
)
def test_a_forged_map_is_refused_by_name_even_with_a_recomputed_checksum(
    forge: Callable[[tensor_pb2.TensorHeader], None], message: str
) -> None:
    header, payload = _frame(_padded())
    forge(header)
    with pytest.raises(WireFormatError, match=message):
        decode_tensor(_resealed(header, payload), payload)


def test_bits_beyond_the_rows_are_refused() -> None:
    x = torch.randn(10, 16)
    x[4] = 0
    header, payload = _frame(x)
    assert len(header.present_rows) == 2
    bits = bytearray(header.present_rows)
    bits[1] |= 0b1000_0000  # row 15 of 10
    header.present_rows = bytes(bits)
    with pytest.raises(WireFormatError, match="beyond the 10 rows"):
        decode_tensor(_resealed(header, payload), payload)


@settings(max_examples=300, deadline=None)
@given(bitmap=st.binary(max_size=12), rows=st.integers(1, 60), width=st.integers(1, 9))
def test_any_map_decodes_to_the_declared_shape_or_is_a_named_error(
    bitmap: bytes, rows: int, width: int
) -> None:
    """Fuzz: whatever map a peer sends with a payload of any plausible length, the receiver either builds a
    tensor of the declared shape (zeros outside the map) or raises a WireFormatError; nothing else."""
    present = sum(bin(b).count("1") for b in bitmap)
    for payload_rows in {present, max(0, present - 1), rows}:
        payload = bytes(4 * width * payload_rows)
        header = tensor_pb2.TensorHeader(
            dtype="float32",
            shape=[rows, width],
            codec="none",
            payload_size=len(payload),
            raw_size=rows * width * 4,
            checksum_version=1,
            present_rows=bitmap,
        )
        try:
            out = decode_tensor(_resealed(header, payload), payload)
        except WireFormatError:
            continue
        assert out.shape == (rows, width) and not out.any()


def test_rows_that_only_start_with_zeros_are_sent_and_both_search_paths_agree() -> None:
    """The search narrows candidates by their first columns (ReLU-like rows start with zeros too) and reads
    a tensor that is mostly padding in one pass: both ways find exactly the rows that are zero."""
    x = torch.relu(torch.randn(64, 32, generator=torch.Generator().manual_seed(3)))
    x[:, :8] = 0  # every row starts with eight zeros: all are candidates until read whole
    x[10, 8:] = 0
    x[11, :31] = 0  # zero but for its last element: present
    rows = zero_rows(x)
    assert rows is not None and rows.present.logical_not().nonzero().flatten().tolist() == [10]
    few = x.clone()
    few[:60] = torch.randn(60, 32).abs() + 1  # a few candidates left: gathered and read
    few_rows = zero_rows(few)
    assert few_rows is None or few_rows.present.logical_not().nonzero().flatten().tolist() == []
    few[62] = 0
    assert zero_rows(few).present.logical_not().nonzero().flatten().tolist() == [62]
    assert zero_rows(torch.randn(64, 32).abs() + 1) is None  # dense: nothing to leave out
