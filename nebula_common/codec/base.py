"""The codec contract shared by every compression scheme, plus the byte-level helpers they build on.

A codec turns a dense floating-point tensor into bytes for the WAN and back. Every
hop that handles a frame (switches, the codec service, the receiving trainer) only
has the header, so a codec must be fully determined by its spec string and must be
able to say, from shape and dtype alone, exactly how many bytes it produces: that
is what lets receivers reject truncated or padded payloads before decoding them and
lets every hop account compression ratios without decoding.
"""

from __future__ import annotations

import math
import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch

SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
"""Dtypes codecs accept, keyed by the torch name that travels in ``TensorHeader.dtype``."""

_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in SUPPORTED_DTYPES.items()}

# Same-width integer dtypes: reinterpreting through them lets numpy (which has no
# bfloat16) serialise every supported dtype and fix byte order in one place.
_TORCH_INT_VIEW: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_LE_INT: dict[int, np.dtype] = {
    1: np.dtype("u1"),
    2: np.dtype("<i2"),
    4: np.dtype("<i4"),
    8: np.dtype("<i8"),
}
_NUMPY_NATIVE_INT: dict[int, np.dtype] = {
    size: dtype.newbyteorder("=") for size, dtype in _NUMPY_LE_INT.items()
}


class CodecError(ValueError):
    """A codec spec, input tensor or payload is invalid; the message says what and why."""


def dtype_name(dtype: torch.dtype) -> str:
    """Torch's short name for a supported dtype ("float32"), as written into tensor headers."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise CodecError(f"unsupported dtype {dtype}; codecs accept {', '.join(SUPPORTED_DTYPES)}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """Resolve a header's dtype string; unknown names are a CodecError, never a KeyError."""
    dtype = SUPPORTED_DTYPES.get(name)
    if dtype is None:
        raise CodecError(f"unsupported dtype {name!r}; expected one of {', '.join(SUPPORTED_DTYPES)}")
    return dtype


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` without allocating a tensor."""
    return torch.empty((), dtype=dtype).element_size()


def numel(shape: Sequence[int]) -> int:
    """Element count of ``shape`` computed with Python ints, so hostile shapes cannot overflow."""
    return math.prod(int(dim) for dim in shape)


def check_input(tensor: torch.Tensor) -> torch.Tensor:
    """Validate an encoder input and return it detached and contiguous.

    Rejecting here (rather than deep inside torch or numpy) gives callers one error
    type and a message that says which property of the tensor was wrong.
    """
    if not isinstance(tensor, torch.Tensor):
        raise CodecError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise CodecError(f"codecs need a dense tensor, got layout {tensor.layout}")
    if tensor.device.type != "cpu":
        # Moving silently would hide a device sync on the training hot path.
        raise CodecError(f"codecs run on CPU tensors, got device {tensor.device}; move it to CPU first")
    dtype_name(tensor.dtype)
    return tensor.detach().contiguous()


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    """Raw little-endian row-major bytes of a CPU tensor of any supported (or int8) dtype."""
    flat = tensor.detach().contiguous().reshape(-1)
    size = flat.element_size()
    array = flat.view(_TORCH_INT_VIEW[size]).numpy()
    if sys.byteorder != "little" and size > 1:
        array = array.astype(_NUMPY_LE_INT[size])
    return array.tobytes()


def tensor_from_bytes(data: bytes | memoryview, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """Build a writable tensor that owns a copy of little-endian ``data``.

    Copying (rather than ``torch.frombuffer`` over the caller's bytes) keeps the
    result valid after the payload buffer is released and avoids torch's warning
    about read-only buffers. The caller must have checked the length.
    """
    size = element_size(dtype)
    array = np.frombuffer(data, dtype=_NUMPY_LE_INT[size]).astype(_NUMPY_NATIVE_INT[size], copy=True)
    return torch.from_numpy(array).view(dtype).reshape(tuple(int(dim) for dim in shape))


def value_range(tensor: torch.Tensor) -> tuple[float, float]:
    """(min, max) of a non-empty CPU tensor in one pass; nan anywhere makes both nan.

    numpy's reductions are markedly faster than torch's for float32/float64 on CPU,
    and codecs use this range to skip whole passes (saturation, non-finite checks)
    in the common case; bfloat16/float16 go through torch.
    """
    if tensor.dtype in (torch.float32, torch.float64):
        array = tensor.detach().contiguous().numpy()
        low, high = float(array.min()), float(array.max())
    else:
        low_t, high_t = torch.aminmax(tensor.detach())
        low, high = float(low_t), float(high_t)
    if math.isnan(low) or math.isnan(high):
        return math.nan, math.nan
    return low, high


class Codec(ABC):
    """One compression scheme, fully described by its canonical ``spec`` string.

    Subclasses implement ``_encode``, ``_decode`` and ``encoded_size``; the public
    ``encode``/``decode`` wrap them with the input and length checks every codec
    needs, so a plug-in cannot forget them and all codecs fail the same way.
    Codecs are stateless and shared (the registry caches them), so they must not
    keep per-call state.
    """

    spec: str
    """Canonical spec string; ``get_codec(codec.spec)`` returns an equivalent codec."""

    def encode(self, tensor: torch.Tensor) -> bytes:
        """Encode a CPU floating-point tensor of any shape (including 0-dim, empty, non-contiguous)."""
        return self._encode(check_input(tensor))

    def decode(self, payload: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Decode ``payload`` into a tensor of the original ``shape`` and ``dtype``.

        The payload length must equal ``encoded_size(shape, dtype)``; anything else
        means truncation or corruption, so it is rejected before any decoding.
        """
        dtype_name(dtype)
        shape = tuple(int(dim) for dim in shape)
        if any(dim < 0 for dim in shape):
            raise CodecError(f"shape {list(shape)} has a negative dimension")
        expected = self.encoded_size(shape, dtype)
        if len(payload) != expected:
            raise CodecError(
                f"{self.spec} payload for shape {list(shape)} {dtype_name(dtype)} must be "
                f"{expected} bytes, got {len(payload)}"
            )
        return self._decode(payload, shape, dtype)

    @abstractmethod
    def encoded_size(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """Exact payload size in bytes for a tensor of ``shape`` and ``dtype``."""

    @abstractmethod
    def _encode(self, tensor: torch.Tensor) -> bytes:
        """Encode a validated, detached, contiguous CPU tensor."""

    @abstractmethod
    def _decode(self, payload: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Decode a payload whose length already matches ``encoded_size``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"
