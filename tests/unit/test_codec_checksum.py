"""The payload CRC-32 is zlib's exactly, whichever library computes it (the wire format must not change)."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import torch

from nebula_common.codec import checksum, decode_tensor, encode_tensor
from nebula_common.codec.wire import header_checksum


@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 4095, 65_537, 3 << 20])
def test_crc32_equals_zlib_for_every_buffer_kind(size: int) -> None:
    data = os.urandom(size)
    for buffer in (
        data,
        bytearray(data),
        memoryview(data),
        memoryview(data)[1:],
        np.frombuffer(data, np.uint8),
    ):
        assert checksum.crc32(buffer) == zlib.crc32(buffer)
        assert checksum.crc32(buffer, 0xDEADBEEF) == zlib.crc32(buffer, 0xDEADBEEF)


def test_crc32_chains_like_zlib() -> None:
    head, tail = os.urandom(1000), os.urandom(70_001)
    assert checksum.crc32(tail, checksum.crc32(head)) == zlib.crc32(head + tail)


def test_isal_is_the_implementation_when_installed() -> None:
    pytest.importorskip("isal")  # a declared dependency: installed by `make install` and the image
    assert checksum.IMPLEMENTATION == "isal"


def test_header_checksum_is_the_documented_zlib_crc() -> None:
    """A tensor encoded now carries the checksum a zlib-only peer computes and accepts."""
    tensor = torch.randn(64, 33)
    encoded = encode_tensor(tensor, "none", job_id="j", edge="e")
    meta_crc = header_checksum(encoded.header, b"")  # the CRC over the header fields alone
    assert encoded.header.checksum == zlib.crc32(bytes(encoded.payload), meta_crc)
    assert torch.equal(decode_tensor(encoded.header, bytes(encoded.payload)), tensor)
