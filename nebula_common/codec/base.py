"""The codec contract shared by every compression scheme, plus the byte-level helpers they build on.

A codec turns a dense floating-point tensor into bytes for the WAN and back. Every
hop that handles a frame (switches, the codec service, the receiving trainer) only
has the header, so a codec must be fully determined by its spec string and must be
able to bound, from shape and dtype alone, how many bytes it produces: that is what
lets receivers reject truncated or padded payloads before decoding them.

The size contract has two kinds of codec:

* fixed-size (``variable_size = False``, every codec except ``zstd``): the payload
  is *exactly* ``encoded_size(shape, dtype)`` bytes, so a receiver rejects any other
  length before decoding, and the ratio is known before encoding;
* variable-size (``variable_size = True``): ``encoded_size`` is a strict *upper
  bound*; the receiver rejects anything longer before decoding, and the codec's own
  decoder must then check the payload's internal structure exactly (zstd checks the
  frame's declared content size and hands the result to its inner fixed-size codec,
  which checks its exact length), so validation is never weaker than for fixed codecs.
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


def reconstruction_error(original: torch.Tensor, decoded: torch.Tensor) -> dict[str, float]:
    """Relative L2 error ``||x - y|| / ||x||`` and max absolute error of a decoded tensor.

    Computed in float64 so the metric itself adds no error; an all-zero original
    gives a relative error of 0 when reproduced exactly and inf otherwise.
    """
    x = original.detach().to(torch.float64).reshape(-1)
    y = decoded.detach().to(torch.float64).reshape(-1)
    if x.numel() == 0:
        return {"rel_l2": 0.0, "max_abs": 0.0}
    diff = x - y
    norm = float(torch.linalg.vector_norm(x))
    err = float(torch.linalg.vector_norm(diff))
    rel = err / norm if norm > 0 else (0.0 if err == 0 else math.inf)
    return {"rel_l2": rel, "max_abs": float(diff.abs().max())}


def matrix_view(shape: Sequence[int]) -> tuple[int, int] | None:
    """The (rows, cols) matrix low-rank codecs factorise: all leading dims become rows.

    An activation ``[batch, seq, hidden]`` is the ``(batch*seq) x hidden`` matrix
    whose rank is bounded by ``hidden``. Scalars, vectors and empty tensors have no
    useful factorisation (None).
    """
    dims = [int(dim) for dim in shape]
    if len(dims) < 2 or numel(dims) == 0:
        return None
    return numel(dims[:-1]), dims[-1]


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


def tensor_bytes_view(tensor: torch.Tensor) -> memoryview:
    """The bytes ``tensor_to_bytes`` would return, as a read-only view of the tensor's memory (no copy).

    For a sender that copies the bytes at once anyway (the edge frames every chunk as it queues the
    tensor): the view is only valid while nobody writes to the tensor. A non-contiguous tensor is made
    contiguous first (a copy), and on big-endian hosts the bytes are swapped into a copy.
    """
    flat = tensor.detach().contiguous().reshape(-1)
    size = flat.element_size()
    if sys.byteorder != "little" and size > 1:
        return memoryview(tensor_to_bytes(flat))
    array = flat.view(_TORCH_INT_VIEW[size]).numpy()
    return memoryview(array).cast("B").toreadonly()


def tensor_from_bytes(
    data: bytes | bytearray | memoryview, dtype: torch.dtype, shape: Sequence[int]
) -> torch.Tensor:
    """Build a writable tensor from little-endian ``data``: a copy, or the ``bytearray`` itself.

    ``bytes`` and views are copied (rather than ``torch.frombuffer`` over the caller's
    bytes), so the result stays valid after the payload buffer is released and never
    aliases read-only memory. A ``bytearray`` is **adopted** on little-endian hosts: the
    tensor is built over its memory (``torch.frombuffer``, no copy) and keeps it alive, so
    the caller hands it over and must not write to it again -- the edge's receive buffer,
    which nothing else holds once the frame is complete, is one. The caller must have
    checked the length.
    """
    size = element_size(dtype)
    dims = tuple(int(dim) for dim in shape)
    if type(data) is bytearray and (sys.byteorder == "little" or size == 1):
        if not data:
            return torch.empty(dims, dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(dims)
    array = np.frombuffer(data, dtype=_NUMPY_LE_INT[size]).astype(_NUMPY_NATIVE_INT[size], copy=True)
    return torch.from_numpy(array).view(dtype).reshape(dims)


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

    variable_size: bool = False
    """True when ``encoded_size`` is only an upper bound (entropy coders); see the module doc."""

    wire: bool = True
    """False for spec values that configure a stream (``ef``, ``delta``, ``start``, ``auto``)
    rather than name a byte format; they never appear in a tensor header."""

    def encode(self, tensor: torch.Tensor, state: dict[str, object] | None = None) -> bytes:
        """Encode a CPU floating-point tensor of any shape (including 0-dim, empty, non-contiguous).

        ``state`` is an optional per-stream dict a stateful codec may use to carry
        information between calls on the same edge (``powersgd`` keeps its warm-start
        factor there); stateless codecs ignore it, and decoding never needs it.
        """
        self._require_wire()
        return self._encode_with_state(check_input(tensor), state)

    def decode(self, payload: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Decode ``payload`` into a tensor of the original ``shape`` and ``dtype``.

        A fixed-size codec's payload must be exactly ``encoded_size(shape, dtype)``
        bytes and a variable-size codec's at most that; anything else means
        truncation or corruption, so it is rejected before any decoding.
        """
        self._require_wire()
        dtype_name(dtype)
        shape = tuple(int(dim) for dim in shape)
        if any(dim < 0 for dim in shape):
            raise CodecError(f"shape {list(shape)} has a negative dimension")
        expected = self.encoded_size(shape, dtype)
        if self.variable_size:
            if len(payload) > expected:
                raise CodecError(
                    f"{self.spec} payload for shape {list(shape)} {dtype_name(dtype)} may be at most "
                    f"{expected} bytes, got {len(payload)}"
                )
        elif len(payload) != expected:
            raise CodecError(
                f"{self.spec} payload for shape {list(shape)} {dtype_name(dtype)} must be "
                f"{expected} bytes, got {len(payload)}"
            )
        return self._decode(payload, shape, dtype)

    def plan_note(self, shape: Sequence[int], dtype: torch.dtype) -> str:
        """Why this codec will not use its preferred layout for ``shape`` ("" when it will).

        Low-rank and top-k codecs fall back to their inner codec when their layout
        would be larger; the note says so (with the break-even rank) so callers can
        record it instead of guessing why the ratio is worse than expected.
        """
        return ""

    def cost_terms(self, shape: Sequence[int], dtype: torch.dtype) -> list[tuple[str, float]]:
        """Work this codec does on ``shape``, as (component, units) pairs for cost models.

        The codec service calibrates seconds per unit for each component on its own
        host and predicts a spec's encode/decode time as the sum over its terms; an
        elementwise codec's unit is one element, a factorisation's is its flop count.
        """
        return [(self.spec, float(numel(shape)))]

    def _require_wire(self) -> None:
        if not self.wire:
            raise CodecError(
                f"{self.spec!r} configures a tensor stream and has no byte format of its own; "
                "use TensorStreamEncoder/TensorStreamDecoder (nebula_common.codec.stream)"
            )

    def _encode_with_state(self, tensor: torch.Tensor, state: dict[str, object] | None) -> bytes:
        """Stateful codecs override this; the default ignores ``state``."""
        return self._encode(tensor)

    @abstractmethod
    def encoded_size(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """Payload size in bytes for ``shape``/``dtype``: exact, or an upper bound if ``variable_size``."""

    @abstractmethod
    def _encode(self, tensor: torch.Tensor) -> bytes:
        """Encode a validated, detached, contiguous CPU tensor."""

    @abstractmethod
    def _decode(self, payload: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Decode a payload whose length already matches ``encoded_size``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"
