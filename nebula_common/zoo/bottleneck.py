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


def _load_saved(path: str, what: str, expected: str) -> object:
    """``torch.load`` of a bottleneck file (tensors only), its failures as one ``BottleneckError`` each."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError as exc:
        raise BottleneckError(f"bottleneck {what} {path} does not exist in this cluster") from exc
    except Exception as exc:  # unpickling errors come in many types
        raise BottleneckError(f"bottleneck {what} {path} is not {expected}: {exc}") from exc


def load_basis_file(path: str, d_model: int, k: int) -> torch.Tensor:
    """A calibration basis saved with ``torch.save`` (a ``[d, k]`` tensor), refused by name unless it fits."""
    basis = _load_saved(path, "basis", "a saved tensor")
    if not isinstance(basis, torch.Tensor) or tuple(basis.shape) != (d_model, k):
        shape = list(basis.shape) if isinstance(basis, torch.Tensor) else type(basis).__name__
        raise BottleneckError(f"bottleneck basis {path} is {shape}, expected [{d_model}, {k}]")
    return basis.float()


def captured_energy(activations: torch.Tensor, basis: torch.Tensor) -> float:
    """Share of the activations' squared norm that the basis keeps (1.0 = lossless)."""
    rows = activations.detach().reshape(-1, activations.shape[-1]).float()
    total = float(rows.pow(2).sum())
    return float((rows @ basis).pow(2).sum()) / total if total else 1.0


def residual_path(d_in: int, d_out: int, hidden: int) -> nn.Sequential:
    """A bias-free ``d_in -> hidden -> d_out`` MLP that is zero at initialisation and maps 0 to 0.

    Bias-free with GELU (GELU(0) = 0): a padding row, exactly zero, stays exactly zero, which
    ABNet's decoder uses to find the padding.
    """
    path = nn.Sequential(nn.Linear(d_in, hidden, bias=False), nn.GELU(), nn.Linear(hidden, d_out, bias=False))
    nn.init.zeros_(path[2].weight)  # the linear path alone at start
    return path


class DownProjection(nn.Module):
    """End of the upstream stage: ``[..., d] -> [..., k]`` (what crosses the WAN), optionally plus ``g(x)``.

    ``residual`` (a hidden width, 0: none) adds a learned non-linear code ``g(x)`` to the linear
    ``x W_down``: what a rank-k linear map of a flat spectrum drops, the upstream stage can still
    encode into the k numbers it sends (zero at initialisation, so step 0 is the calibrated subspace).
    """

    def __init__(self, d_model: int, k: int, basis: torch.Tensor | None = None, *, residual: int = 0) -> None:
        super().__init__()
        check_rank(d_model, k)
        if isinstance(residual, bool) or not isinstance(residual, int) or residual < 0:
            raise BottleneckError(
                f"the down-projection's residual width must be an integer >= 0, got {residual!r}"
            )
        self.proj = nn.Linear(d_model, k, bias=False)
        self.residual: nn.Module | None = residual_path(d_model, k, residual) if residual else None
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
        out = self.proj(x)
        return out + self.residual(x) if self.residual is not None else out


class UpProjection(nn.Module):
    """Start of the downstream stage: ``[..., k] -> [..., d]``, optionally plus a learned ``ff(z)``."""

    def __init__(
        self, d_model: int, k: int, basis: torch.Tensor | None = None, *, residual: bool | int = False
    ) -> None:
        super().__init__()
        check_rank(d_model, k)
        self.proj = nn.Linear(k, d_model, bias=False)
        self.residual: nn.Module | None = None
        if residual:  # True: the default hidden width max(4k, 16); an integer > 1: that width
            self.residual = residual_path(k, d_model, max(4 * k, 16) if residual is True else int(residual))
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


def pretrain_bottleneck(
    down: DownProjection, up: UpProjection, activations: torch.Tensor, steps: int, seed: int = 0
) -> float:
    """Train both halves as an autoencoder (``up(down(x)) ~ x``) on calibration activations; energy kept.

    Why: a linear rank-k start keeps only the top-k share of a flat spectrum (69% at k = 16 of
    ABNet's d = 64 cut); with residual paths on both halves, a few thousand steps of this
    reconstruction loss (no labels, no link: the upstream stage's own activations) learn a
    non-linear code that keeps far more (88% at k = 16), before fine-tuning starts. Mean squared
    error over the non-zero rows, Adam 3e-3, 1,024 rows a step; returns the share of the rows'
    squared norm the reconstruction keeps (1 - relative squared error, ``captured_energy``'s
    non-linear analogue).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise BottleneckError(f"bottleneck pre-training steps must be an integer >= 0, got {steps!r}")
    rows = activations.detach().reshape(-1, activations.shape[-1]).float()
    rows = rows[rows.abs().amax(dim=1) > 0]
    if not len(rows):
        raise BottleneckError("bottleneck pre-training needs calibration activations with non-zero rows")
    generator = torch.Generator().manual_seed(2000 + seed)
    optimizer = torch.optim.Adam([*down.parameters(), *up.parameters()], lr=3e-3)
    for _ in range(steps):
        batch = rows[torch.randint(len(rows), (1024,), generator=generator)]
        loss = (up(down(batch)) - batch).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        return 1.0 - float((up(down(rows)) - rows).pow(2).sum() / rows.pow(2).sum())


def calibrate(
    activations: torch.Tensor, k: int, residual: int = 256, steps: int = 3000, seed: int = 0
) -> tuple[DownProjection, UpProjection, float]:
    """Both halves from calibration activations: the principal start, then ``steps`` of autoencoder training.

    ``residual``: the hidden width of both halves' residual paths (0: linear halves, and then
    the pre-training only refines the principal subspace). Returns the halves and the energy
    their reconstruction keeps. Save them with ``save_halves`` and hand the file to both stages
    (the ``abnet`` job's ``cut_init``; docs/codecs.md).
    """
    basis = principal_basis(activations, k)
    d_model = activations.shape[-1]
    down = DownProjection(d_model, k, basis, residual=residual)
    up = UpProjection(d_model, k, basis, residual=residual or False)
    energy = pretrain_bottleneck(down, up, activations, steps, seed)
    return down, up, energy


def save_halves(path: str, down: DownProjection, up: UpProjection) -> None:
    """One file for both stages (each loads its own half: ``load_half``)."""
    torch.save({"down": down.state_dict(), "up": up.state_dict()}, path)


def load_half(path: str, half: str, module: nn.Module) -> None:
    """Load ``half`` ("down" or "up") of a ``save_halves`` file into ``module``; refused unless it fits."""
    saved = _load_saved(path, "init", "a saved state")
    if not isinstance(saved, dict) or not isinstance(saved.get(half), dict):
        raise BottleneckError(f"bottleneck init {path} has no {half!r} half (write it with save_halves)")
    expected = {name: list(value.shape) for name, value in module.state_dict().items()}
    found = {
        name: list(value.shape) for name, value in saved[half].items() if isinstance(value, torch.Tensor)
    }
    if found != expected:
        raise BottleneckError(
            f"bottleneck init {path}: its {half} half {found} does not fit this stage's {expected} "
            "(same d_model, cut_k and cut_residual as when it was saved?)"
        )
    module.load_state_dict(saved[half])


__all__ = [
    "BottleneckError",
    "DownProjection",
    "UpProjection",
    "calibrate",
    "captured_energy",
    "check_rank",
    "load_basis_file",
    "load_half",
    "pretrain_bottleneck",
    "principal_basis",
    "residual_path",
    "save_halves",
    "shared_basis",
]
