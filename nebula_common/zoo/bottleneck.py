"""A learned bottleneck at the cut: d -> k at the end of the upstream stage, k -> d at the start of the next.

Why: a wire codec compresses what the stage produces; a bottleneck changes what it
produces. The upstream stage ends in a trainable down-projection ``z = x W_down``
(``[..., d] -> [..., k]``) and only ``z`` crosses the WAN, so the activations *and*
their gradients (``dL/dz``, also ``[..., k]``) shrink by ``d / k`` without any
codec, and any wire codec (``int8``, ``fp16``) then applies to the k-dim tensor.
The downstream stage starts with the up-projection ``x' = z W_up`` and, with
``residual``, adds a small learned correction ``ff(z)`` (ResBM-style: the linear
path reconstructs the subspace, the residual path learns what the linear map
cannot), zero at initialisation.

Initialisation: both projections start from the principal subspace of calibration
activations (the top-k right singular vectors ``V_k`` of real cut activations,
uncentred): ``W_down = V_k``, ``W_up = V_k^T``, so ``x' = x V_k V_k^T`` is the best
rank-k linear reconstruction at step 0 and a hot-started (pre-trained) model keeps
what it knew, instead of starting from a random projection. Uncentred and bias-free
on purpose: a zero row (a padding position, which ABNet's decoder recognises by
being exactly zero) stays exactly zero on both sides.

Each half is an ``nn.Module`` owned by its stage's model, so its parameters are in
that stage's optimizer and checkpoints like every other weight; the two halves
share nothing at run time (the downstream half is initialised from the same
calibration basis, which the upstream stage computes and the job hands to both).
"""

from __future__ import annotations

import torch
from torch import nn


class BottleneckError(ValueError):
    """A bottleneck was asked for with a shape or calibration that cannot work; the message says which."""


def check_rank(d_model: int, k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < d_model:
        raise BottleneckError(
            f"bottleneck rank k must be an integer in 1..{d_model - 1} (d={d_model}), got {k!r}"
        )


def principal_basis(activations: torch.Tensor, k: int) -> torch.Tensor:
    """The top-k right singular vectors (``[d, k]``) of the non-zero rows of ``activations`` ``[..., d]``."""
    rows = activations.detach().reshape(-1, activations.shape[-1]).float()
    check_rank(rows.shape[1], k)
    rows = rows[rows.abs().amax(dim=1) > 0]
    if rows.shape[0] < k:
        raise BottleneckError(f"calibration has {rows.shape[0]} non-zero rows, fewer than k={k}")
    _, _, vh = torch.linalg.svd(rows, full_matrices=False)
    return vh[:k].T.contiguous()


def shared_basis(d_model: int, k: int, seed: int = 0x4E42) -> torch.Tensor:
    """A random orthonormal ``[d, k]`` basis both sides derive alike from a seed (no calibration at hand).

    The Protocol-Models-style fallback: the subspace is shared by construction, so
    ``W_up = W_down^T`` at step 0 without either side seeing the other's data.
    """
    check_rank(d_model, k)
    generator = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(d_model, k, generator=generator), mode="reduced").Q.contiguous()


def load_basis_file(path: str, d_model: int, k: int) -> torch.Tensor:
    """A calibration basis saved with ``torch.save`` (a ``[d, k]`` tensor), refused by name unless it fits."""
    try:
        basis = torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError as exc:
        raise BottleneckError(f"bottleneck basis {path} does not exist in this cluster") from exc
    except Exception as exc:  # unpickling errors come in many types
        raise BottleneckError(f"bottleneck basis {path} is not a saved tensor: {exc}") from exc
    if not isinstance(basis, torch.Tensor) or tuple(basis.shape) != (d_model, k):
        shape = list(basis.shape) if isinstance(basis, torch.Tensor) else type(basis).__name__
        raise BottleneckError(f"bottleneck basis {path} is {shape}, expected [{d_model}, {k}]")
    return basis.float()


def captured_energy(activations: torch.Tensor, basis: torch.Tensor) -> float:
    """Share of the activations' squared norm that the basis keeps (1.0 = lossless)."""
    rows = activations.detach().reshape(-1, activations.shape[-1]).float()
    total = float(rows.pow(2).sum())
    return float((rows @ basis).pow(2).sum()) / total if total else 1.0


class DownProjection(nn.Module):
    """End of the upstream stage: ``[..., d] -> [..., k]`` (what crosses the WAN)."""

    def __init__(self, d_model: int, k: int, basis: torch.Tensor | None = None) -> None:
        super().__init__()
        check_rank(d_model, k)
        self.proj = nn.Linear(d_model, k, bias=False)
        if basis is not None:
            self.load_basis(basis)

    def load_basis(self, basis: torch.Tensor) -> None:
        if tuple(basis.shape) != (self.proj.in_features, self.proj.out_features):
            raise BottleneckError(
                f"basis shape {list(basis.shape)} does not fit "
                f"d={self.proj.in_features}, k={self.proj.out_features}"
            )
        with torch.no_grad():
            self.proj.weight.copy_(basis.T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.proj.in_features:
            raise BottleneckError(f"expected activations of width {self.proj.in_features}, got {x.shape[-1]}")
        return self.proj(x)


class UpProjection(nn.Module):
    """Start of the downstream stage: ``[..., k] -> [..., d]``, optionally plus a learned ``ff(z)``."""

    def __init__(
        self, d_model: int, k: int, basis: torch.Tensor | None = None, *, residual: bool = False
    ) -> None:
        super().__init__()
        check_rank(d_model, k)
        self.proj = nn.Linear(k, d_model, bias=False)
        self.residual: nn.Module | None = None
        if residual:
            hidden = max(4 * k, 16)
            self.residual = nn.Sequential(
                nn.Linear(k, hidden, bias=False), nn.GELU(), nn.Linear(hidden, d_model, bias=False)
            )
            nn.init.zeros_(self.residual[2].weight)  # the identity of the linear path at start
        if basis is not None:
            self.load_basis(basis)

    def load_basis(self, basis: torch.Tensor) -> None:
        if tuple(basis.shape) != (self.proj.out_features, self.proj.in_features):
            raise BottleneckError(
                f"basis shape {list(basis.shape)} does not fit "
                f"d={self.proj.out_features}, k={self.proj.in_features}"
            )
        with torch.no_grad():
            self.proj.weight.copy_(basis)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if z.shape[-1] != self.proj.in_features:
            raise BottleneckError(
                f"expected a bottleneck of width {self.proj.in_features}, got {z.shape[-1]}"
            )
        out = self.proj(z)
        return out + self.residual(z) if self.residual is not None else out


__all__ = [
    "BottleneckError",
    "DownProjection",
    "UpProjection",
    "captured_energy",
    "check_rank",
    "load_basis_file",
    "principal_basis",
    "shared_basis",
]
