"""The edge's two zero-copy steps: a borrowed ``none`` payload views the tensor, a received
``bytearray`` becomes the tensor's memory; both give exactly the bytes and tensors of the copying path."""

from __future__ import annotations

import gc

import torch

from nebula_common.codec import TensorStreamDecoder, TensorStreamEncoder, decode_tensor, encode_tensor
from nebula_common.codec.base import tensor_bytes_view, tensor_from_bytes, tensor_to_bytes
from nebula_common.codec.wire import decode_integer_tensor, encode_integer_tensor

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8)


def _sample(dtype: torch.dtype, shape: tuple[int, ...] = (6, 5)) -> torch.Tensor:
    return (torch.randn(shape) * 50).to(dtype)


def test_view_has_the_copys_bytes_for_every_layout() -> None:
    cases = [_sample(dtype) for dtype in DTYPES] + [
        torch.randn(0),
        torch.tensor(2.5),
        torch.randn(4, 7).t(),  # not contiguous: made contiguous first
    ]
    for tensor in cases:
        view = tensor_bytes_view(tensor)
        assert view.readonly
        assert bytes(view) == tensor_to_bytes(tensor)


def test_view_shares_the_tensors_memory() -> None:
    tensor = torch.randn(1000)
    view = tensor_bytes_view(tensor)
    tensor[0] = 123.0  # what a caller must not do before the view was copied: it shows through
    assert bytes(view[:4]) == tensor_to_bytes(tensor[:1])


def test_borrowed_encoding_equals_the_copying_one() -> None:
    tensor = torch.randn(33, 17)
    copied = encode_tensor(tensor, "none", job_id="j", edge="e", frame_id=3)
    borrowed = encode_tensor(tensor, "none", borrow=True, job_id="j", edge="e", frame_id=3)
    assert isinstance(borrowed.payload, memoryview)
    assert borrowed.header == copied.header  # same sizes, same CRC-32
    assert bytes(borrowed.payload) == copied.payload
    # Codecs that compute a payload ignore borrow: their bytes are new anyway.
    assert encode_tensor(tensor, "fp16", borrow=True).payload == encode_tensor(tensor, "fp16").payload
    ids = torch.arange(10)
    borrowed_ids = encode_integer_tensor(ids, borrow=True, frame_id=1)
    assert borrowed_ids.header == encode_integer_tensor(ids, frame_id=1).header


def test_stream_encoder_borrows_and_the_decoder_adopts() -> None:
    encoder, decoder = TensorStreamEncoder("none"), TensorStreamDecoder("none")
    tensor = torch.randn(8, 9)
    encoded = encoder.encode(tensor, step=0, borrow=True, frame_id=0)
    received = bytearray(encoded.payload)  # what the edge's receive buffer holds
    decoded = decoder.decode(encoded.header, received)
    assert torch.equal(decoded, tensor)
    assert decoded.data_ptr() == torch.frombuffer(received, dtype=torch.uint8).data_ptr()  # no copy
    decoded += 1  # writable, and it is the buffer's memory now
    assert torch.equal(tensor_from_bytes(bytes(received), torch.float32, (8, 9)), tensor + 1)


def test_adopting_a_bytearray_gives_the_copying_result() -> None:
    for dtype in DTYPES:
        tensor = _sample(dtype)
        raw = tensor_to_bytes(tensor)
        adopted = tensor_from_bytes(bytearray(raw), dtype, tensor.shape)
        copied = tensor_from_bytes(raw, dtype, tensor.shape)
        assert adopted.dtype == copied.dtype == dtype
        assert torch.equal(adopted, tensor) and torch.equal(copied, tensor)
    assert tensor_from_bytes(bytearray(), torch.float32, (0, 3)).shape == (0, 3)


def test_bytes_are_still_copied() -> None:
    raw = bytearray(tensor_to_bytes(torch.ones(4)))
    copied = tensor_from_bytes(memoryview(raw), torch.float32, (4,))
    raw[:4] = tensor_to_bytes(torch.zeros(1))
    assert torch.equal(copied, torch.ones(4))  # a view is not adopted: the tensor owns a copy


def test_integer_payloads_adopt_too() -> None:
    ids = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    encoded = encode_integer_tensor(ids, borrow=True)
    buffer = bytearray(encoded.payload)
    decoded = decode_integer_tensor(encoded.header, buffer)
    assert torch.equal(decoded, ids)
    assert decoded.data_ptr() == torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    assert torch.equal(
        decode_tensor(
            encode_tensor(ids.float(), "none").header, bytearray(encode_tensor(ids.float(), "none").payload)
        ),
        ids.float(),
    )


def test_an_adopted_buffer_lives_as_long_as_its_tensor() -> None:
    def receive() -> torch.Tensor:
        buffer = bytearray(tensor_to_bytes(torch.arange(1 << 16, dtype=torch.float32)))
        return tensor_from_bytes(buffer, torch.float32, (1 << 16,))  # the only reference goes with it

    tensor = receive()
    gc.collect()
    churn = [bytearray(b"\xff" * (1 << 20)) for _ in range(8)]  # reuse of freed memory would show
    assert len(churn) == 8
    assert torch.equal(tensor, torch.arange(1 << 16, dtype=torch.float32))
