"""Transform codecs: reshape a tensor into smaller float parts, then encode the parts with a leaf codec.

Low rank (``svd``, ``lowrank``, ``powersgd``) and sparsification (``topk``) do not
produce bytes themselves: they turn the tensor into a few smaller float tensors
(factors, or the kept values) plus optional side bytes (top-k's indices). Those
parts are then stored by an elementwise *leaf* codec (``none``, ``fp16``, ``bf16``,
``int8``, ``int4``), which is how the paper's nesting ``FP16(SVD(0.6))`` is
spelled: ``fp16(svd(0.6))`` is ``svd(0.6)`` with its factors stored as fp16, and
plain ``svd(0.6)`` stores them as float32 (leaf ``none``).

A transform only pays when its parts are smaller than the tensor: for an m x n
matrix the truncated-SVD factors are smaller only for rank r < mn / (m + n + 1).
Every transform codec therefore compares, from shape alone, the bytes of its
layout with the bytes of its leaf applied to the whole tensor, and takes the
smaller. The choice is deterministic (both ends compute it from the header), is
recorded in the payload's first byte (so a disagreement is detected, not decoded
wrongly), and ``plan_note`` says why a fallback happened.

Payload: ``mode`` (1 byte: 0 = transform layout, 1 = dense fallback), then for
the transform layout the side bytes and each part's leaf payload in order, or for
the fallback the leaf payload of the whole tensor.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nebula_common.codec.base import Codec, CodecError

MODE_TRANSFORM = 0
MODE_DENSE = 1
_MODE_NAMES = {MODE_TRANSFORM: "transform", MODE_DENSE: "dense fallback"}


@dataclass(frozen=True)
class TransformPlan:
    """The layout a transform uses for one shape: float part shapes and side-byte count."""

    part_shapes: tuple[tuple[int, ...], ...]
    side_bytes: int = 0
    detail: str = ""
    """Human description (e.g. "rank 12 of 128"), used in fallback notes."""


@dataclass(frozen=True)
class Layout:
    """What a transform codec sends for one (shape, dtype): which mode, how many bytes, and why."""

    mode: int
    plan: TransformPlan | None
    size: int
    note: str


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Factorisations run in float32 (float64 input keeps float64): half precision LAPACK is not a thing."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def require_finite(tensor: torch.Tensor, spec: str) -> None:
    """Reject nan/inf up front: a factorisation or top-k of them is garbage for every element."""
    if tensor.numel() and not bool(torch.isfinite(tensor).all()):
        raise CodecError(f"{spec} cannot encode non-finite values (nan or inf in the tensor)")


class Transform(ABC):
    """The shape-changing half of a transform codec; stateless unless it uses the per-stream ``state``."""

    spec: str

    @abstractmethod
    def plan(self, shape: tuple[int, ...]) -> TransformPlan | None:
        """The layout for ``shape``, or None when the transform does not apply to it."""

    @abstractmethod
    def why_not(self, shape: tuple[int, ...]) -> str:
        """Why ``plan`` returned None for ``shape`` (only called in that case)."""

    @abstractmethod
    def split(
        self, tensor: torch.Tensor, plan: TransformPlan, state: dict[str, object] | None
    ) -> tuple[list[torch.Tensor], bytes]:
        """Float parts (shapes as planned, in ``work_dtype``) and exactly ``plan.side_bytes`` side bytes."""

    @abstractmethod
    def merge(
        self, parts: list[torch.Tensor], side: bytes, plan: TransformPlan, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """Rebuild the tensor (any float dtype) from decoded parts; must validate ``side``."""

    @abstractmethod
    def cost_units(self, shape: tuple[int, ...]) -> float:
        """Work of ``split`` for ``shape`` (flops, or elements for selection), for cost models."""

    def break_even(self, shape: tuple[int, ...]) -> str:
        """Extra explanation for a size fallback (e.g. the largest rank that pays)."""
        return ""


class TransformCodec(Codec):
    """A transform whose parts are stored with a leaf codec; see the module docstring for the payload."""

    def __init__(self, transform: Transform, leaf: Codec, spec: str) -> None:
        if leaf.variable_size or isinstance(leaf, TransformCodec) or not leaf.wire:
            raise CodecError(f"{spec}: the inner codec must be elementwise (none, fp16, bf16, int8, int4)")
        self.transform = transform
        self.leaf = leaf
        self.spec = spec

    def layout(self, shape: Sequence[int], dtype: torch.dtype) -> Layout:
        """Choose between the transform layout and the dense fallback for ``shape``, by bytes."""
        dims = tuple(int(dim) for dim in shape)
        dense = 1 + self.leaf.encoded_size(dims, dtype)
        plan = self.transform.plan(dims)
        if plan is None:
            return Layout(
                MODE_DENSE,
                None,
                dense,
                f"{self.spec}: {self.transform.why_not(dims)}; sent whole with {self.leaf.spec}",
            )
        part_dtype = work_dtype(dtype)
        size = 1 + plan.side_bytes + sum(self.leaf.encoded_size(p, part_dtype) for p in plan.part_shapes)
        if size >= dense:
            extra = self.transform.break_even(dims)
            return Layout(
                MODE_DENSE,
                None,
                dense,
                f"{self.spec} on {list(dims)}: {plan.detail} needs {size} bytes, not fewer than the "
                f"{dense} of {self.leaf.spec} on the whole tensor{'; ' + extra if extra else ''}; "
                f"sent whole with {self.leaf.spec}",
            )
        return Layout(MODE_TRANSFORM, plan, size, "")

    def encoded_size(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return self.layout(shape, dtype).size

    def plan_note(self, shape: Sequence[int], dtype: torch.dtype) -> str:
        return self.layout(shape, dtype).note

    def cost_terms(self, shape: Sequence[int], dtype: torch.dtype) -> list[tuple[str, float]]:
        dims = tuple(int(dim) for dim in shape)
        layout = self.layout(dims, dtype)
        if layout.plan is None:
            return self.leaf.cost_terms(dims, dtype)
        terms = [(type(self.transform).__name__, self.transform.cost_units(dims))]
        for part in layout.plan.part_shapes:
            terms += self.leaf.cost_terms(part, work_dtype(dtype))
        return terms

    def _encode(self, tensor: torch.Tensor) -> bytes:
        return self._encode_with_state(tensor, None)

    def _encode_with_state(self, tensor: torch.Tensor, state: dict[str, object] | None) -> bytes:
        shape = tuple(tensor.shape)
        layout = self.layout(shape, tensor.dtype)
        if layout.plan is None:
            return bytes([MODE_DENSE]) + self.leaf.encode(tensor)
        require_finite(tensor, self.spec)
        parts, side = self.transform.split(tensor.to(work_dtype(tensor.dtype)), layout.plan, state)
        if len(side) != layout.plan.side_bytes:
            raise CodecError(
                f"{self.spec}: produced {len(side)} side bytes, planned {layout.plan.side_bytes}"
            )
        chunks = [bytes([MODE_TRANSFORM]), side]
        for part, part_shape in zip(parts, layout.plan.part_shapes, strict=True):
            if tuple(part.shape) != part_shape:
                raise CodecError(f"{self.spec}: part of shape {list(part.shape)}, planned {list(part_shape)}")
            chunks.append(self.leaf.encode(part))
        return b"".join(chunks)

    def _decode(self, payload: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        layout = self.layout(shape, dtype)
        mode = payload[0]
        if mode != layout.mode:
            got = _MODE_NAMES.get(mode, f"unknown mode {mode}")
            raise CodecError(
                f"{self.spec} payload is in {got} layout but shape {list(shape)} implies "
                f"{_MODE_NAMES[layout.mode]} (header shape or payload corrupt)"
            )
        if layout.plan is None:
            return self.leaf.decode(payload[1:], shape, dtype)
        plan = layout.plan
        offset = 1 + plan.side_bytes
        side = payload[1:offset]
        parts = []
        part_dtype = work_dtype(dtype)
        for part_shape in plan.part_shapes:
            size = self.leaf.encoded_size(part_shape, part_dtype)
            parts.append(self.leaf.decode(payload[offset : offset + size], part_shape, part_dtype))
            offset += size
        for part in parts:
            if part.numel() and not bool(torch.isfinite(part).all()):
                raise CodecError(f"{self.spec} payload holds non-finite factor values")
        return self.transform.merge(parts, side, plan, shape).to(dtype)


def check_inner(name: str, inner: object) -> Codec | None:
    """Validate the optional positional argument of a leaf codec: it must be a codec spec, not a number."""
    if inner is None or isinstance(inner, Codec):
        return inner
    raise CodecError(
        f"{name}'s argument must be a low-rank or top-k codec spec such as svd(0.6), got {inner!r}; "
        f"options are keywords, e.g. int8(scale=row)"
    )


def wrap_transform(leaf_name: str, inner: Codec, leaf: Codec, spec: str) -> Codec:
    """``leaf(inner)``: store a plain transform codec's parts with ``leaf`` (``fp16(svd(0.6))``)."""
    if not isinstance(inner, TransformCodec):
        raise CodecError(
            f"{leaf_name} can only wrap a low-rank or top-k codec (svd, lowrank, powersgd, topk), "
            f"got {inner.spec!r}; e.g. {leaf_name}(svd(0.6))"
        )
    if inner.leaf.spec != "none":
        raise CodecError(
            f"{leaf_name}({inner.spec}): {inner.spec} already stores its parts as {inner.leaf.spec}"
        )
    return TransformCodec(inner.transform, leaf, spec)


def round_half_up(value: float) -> int:
    """Rounding for "keep a fraction" arguments: 0.5 of 5 singular values keeps 3, never banker's 2."""
    return math.floor(value + 0.5)
