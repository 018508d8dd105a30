"""Low-rank codecs: the paper's truncated SVD and two far cheaper rank-k approximations.

All three view a tensor as the matrix ``(prod(shape[:-1])) x shape[-1]`` (an
activation ``[batch, seq, hidden]`` has rank at most ``hidden``) and send factors
instead of the matrix.

* ``svd(r)``: the paper's section 2.3. A full ``torch.linalg.svd``, keeping
  ``round(r * min(m, n))`` singular values; sends ``U_r`` (m x k), ``S_r`` (k) and
  ``V_r^T`` (k x n), i.e. formula (4): ``R_svd = (m k + k + k n) / (m n)``. Optimal
  (Eckart-Young) but costs O(m n min(m, n)): the paper's FP16(SVD(0.9)) ran slower
  than FP16 alone because of it.
* ``lowrank(k)``: randomized SVD (Halko, Martinsson, Tropp 2011): project onto
  k + oversampling random directions, one power iteration with re-orthonormalisation,
  then the top-k subspace of the small (k + p) x n matrix. O(m n k); sends ``U_k``
  (m x k) and ``V_k S_k`` (n x k), i.e. k (m + n) values.
* ``powersgd(k)``: PowerSGD (Vogels et al. 2019): one power iteration per call,
  warm-started from the previous call's right factor on the same stream (the
  per-stream ``state``), so successive similar tensors converge to their top-k
  subspace at the cost of two m x n x k products. Without state it starts from a
  fixed random matrix and does two iterations.

The random matrices come from a fixed seed so encoding is deterministic, which
keeps benchmark and test results reproducible. Decoding never needs the state:
the factors are in the payload.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from nebula_common.codec.base import Codec, CodecError, matrix_view
from nebula_common.codec.floating import NoneCodec
from nebula_common.codec.registry import format_spec, register_codec
from nebula_common.codec.transform import Transform, TransformCodec, TransformPlan, round_half_up

_SEED = 0x4E42  # "NB": any fixed value; determinism is what matters
OVERSAMPLE = 8
"""Extra random directions for ``lowrank``: the usual choice that makes the error near-optimal."""
POWER_ITERATIONS = 1
"""Power iterations for ``lowrank``; each costs two m x n x l products. One keeps the error within a few
percent of the Eckart-Young optimum on activations, gradients and even white noise (see the benchmark)."""


@lru_cache(maxsize=64)
def _gaussian(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """The fixed test matrix for a shape (cached: callers only read it)."""
    generator = torch.Generator().manual_seed(_SEED)
    return torch.randn(rows, cols, generator=generator, dtype=dtype)


def _orthonormal(matrix: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(matrix, mode="reduced").Q


def _no_matrix(shape: tuple[int, ...]) -> str:
    return f"shape {list(shape)} is not a non-empty matrix (needs >= 2 dims)"


class SvdTransform(Transform):
    """Truncated SVD keeping a ratio of the singular values (formula (4) of the paper)."""

    def __init__(self, ratio: float) -> None:
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
            raise CodecError(f"svd takes the ratio of singular values to keep, in (0, 1], got {ratio!r}")
        self.ratio = ratio
        self.spec = format_spec("svd", ratio)

    def rank(self, m: int, n: int) -> int:
        """Singular values kept for an m x n matrix: ``round(ratio * min(m, n))``, at least 1."""
        full = min(m, n)
        return min(full, max(1, round_half_up(self.ratio * full)))

    def plan(self, shape: tuple[int, ...]) -> TransformPlan | None:
        view = matrix_view(shape)
        if view is None:
            return None
        m, n = view
        k = self.rank(m, n)
        return TransformPlan(
            ((m, k), (k,), (k, n)), 0, f"rank {k} of {min(m, n)} (U, S, V^T: {k * (m + n + 1)} values)"
        )

    def why_not(self, shape: tuple[int, ...]) -> str:
        return _no_matrix(shape)

    def break_even(self, shape: tuple[int, ...]) -> str:
        view = matrix_view(shape)
        if view is None:
            return ""
        m, n = view
        return f"factors are smaller than the matrix only for rank < mn/(m+n+1) = {m * n / (m + n + 1):.1f}"

    def split(
        self, tensor: torch.Tensor, plan: TransformPlan, state: dict[str, object] | None
    ) -> tuple[list[torch.Tensor], bytes]:
        (m, k), _, (_, n) = plan.part_shapes
        u, s, vh = torch.linalg.svd(tensor.reshape(m, n), full_matrices=False)
        return [u[:, :k].contiguous(), s[:k].contiguous(), vh[:k].contiguous()], b""

    def merge(
        self, parts: list[torch.Tensor], side: bytes, plan: TransformPlan, shape: tuple[int, ...]
    ) -> torch.Tensor:
        u, s, vh = parts
        return ((u * s) @ vh).reshape(shape)

    def cost_units(self, shape: tuple[int, ...]) -> float:
        view = matrix_view(shape)
        if view is None:
            return 0.0
        m, n = view
        return float(m) * n * min(m, n)


class _RankK(Transform):
    """Shared layout of ``lowrank``/``powersgd``: left factor (m x k) and right factor (n x k)."""

    name: str

    def __init__(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise CodecError(f"{self.name} takes a rank (an integer >= 1), got {rank!r}")
        self.k = rank
        self.spec = format_spec(self.name, rank)

    def plan(self, shape: tuple[int, ...]) -> TransformPlan | None:
        view = matrix_view(shape)
        if view is None:
            return None
        m, n = view
        k = min(self.k, m, n)
        return TransformPlan(((m, k), (n, k)), 0, f"rank {k} (two factors: {k * (m + n)} values)")

    def why_not(self, shape: tuple[int, ...]) -> str:
        return _no_matrix(shape)

    def break_even(self, shape: tuple[int, ...]) -> str:
        view = matrix_view(shape)
        if view is None:
            return ""
        m, n = view
        return f"factors are smaller than the matrix only for rank < mn/(m+n) = {m * n / (m + n):.1f}"

    def merge(
        self, parts: list[torch.Tensor], side: bytes, plan: TransformPlan, shape: tuple[int, ...]
    ) -> torch.Tensor:
        left, right = parts
        return (left @ right.T).reshape(shape)


class LowRankTransform(_RankK):
    """Randomized SVD: near-optimal rank-k factors for O(m n k) instead of O(m n min(m, n))."""

    name = "lowrank"

    def split(
        self, tensor: torch.Tensor, plan: TransformPlan, state: dict[str, object] | None
    ) -> tuple[list[torch.Tensor], bytes]:
        (m, k), (n, _) = plan.part_shapes
        matrix = tensor.reshape(m, n)
        width = min(k + OVERSAMPLE, m, n)
        basis = _orthonormal(matrix @ _gaussian(n, width, matrix.dtype))
        for _ in range(POWER_ITERATIONS):
            basis = _orthonormal(matrix @ _orthonormal(matrix.T @ basis))
        # The best rank-k approximation of basis @ small is basis @ (top-k projection of small).
        # The top-k left singular vectors of the small (width x n) matrix are the top
        # eigenvectors of its width x width Gram matrix: a tiny float64 eigh instead of an
        # SVD, and no division by singular values, so rank-deficient input stays finite.
        small = basis.T @ matrix
        _, vectors = torch.linalg.eigh((small @ small.T).to(torch.float64))
        top = vectors[:, -k:].flip(1).to(matrix.dtype)  # eigh sorts ascending
        return [(basis @ top).contiguous(), (small.T @ top).contiguous()], b""

    def cost_units(self, shape: tuple[int, ...]) -> float:
        view = matrix_view(shape)
        if view is None:
            return 0.0
        m, n = view
        width = min(self.k + OVERSAMPLE, m, n)
        return float(m) * n * width * (2 * POWER_ITERATIONS + 2)


class PowerSgdTransform(_RankK):
    """PowerSGD's compressor: warm-started power iteration, one per call once warm."""

    name = "powersgd"

    def split(
        self, tensor: torch.Tensor, plan: TransformPlan, state: dict[str, object] | None
    ) -> tuple[list[torch.Tensor], bytes]:
        (m, k), (n, _) = plan.part_shapes
        matrix = tensor.reshape(m, n)
        key = f"powersgd:{m}x{n}:{k}:{matrix.dtype}"
        previous = state.get(key) if state is not None else None
        if isinstance(previous, torch.Tensor):
            right, iterations = previous, 1
        else:
            right, iterations = _gaussian(n, k, matrix.dtype), 2
        for _ in range(iterations):
            left = _orthonormal(matrix @ right)
            right = matrix.T @ left
        if state is not None:
            state[key] = right.clone()
        return [left.contiguous(), right.contiguous()], b""

    def cost_units(self, shape: tuple[int, ...]) -> float:
        view = matrix_view(shape)
        if view is None:
            return 0.0
        m, n = view
        return float(m) * n * min(self.k, m, n) * 2


def _svd(ratio: float) -> Codec:
    transform = SvdTransform(ratio)
    return TransformCodec(transform, NoneCodec(), transform.spec)


def _lowrank(rank: int) -> Codec:
    transform = LowRankTransform(rank)
    return TransformCodec(transform, NoneCodec(), transform.spec)


def _powersgd(rank: int) -> Codec:
    transform = PowerSgdTransform(rank)
    return TransformCodec(transform, NoneCodec(), transform.spec)


register_codec("svd", _svd)
register_codec("lowrank", _lowrank)
register_codec("powersgd", _powersgd)
