"""ABNet with a learned bottleneck at the cut: a stage's half of it from the stage's options.

Cluster S's encoder ends in the down-projection ``d -> k`` (only ``k`` values a position cross the
link), cluster T's decoder starts with the up-projection ``k -> d``; the options (``cut_k``,
``cut_basis``, ``cut_residual``, ``cut_init``, ``cut_lr``) are refused by name when wrong, at build
time. The projections themselves are ``nebula_common.zoo.bottleneck``'s.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from nebula_common.zoo.adapters import AdapterTransformerDecoder, AdapterTransformerEncoder
from nebula_common.zoo.bottleneck import (
    BottleneckError,
    DownProjection,
    UpProjection,
    load_basis_file,
    load_half,
    shared_basis,
)

__all__ = [
    "DEFAULT_CUT_LR",
    "CutDecoder",
    "CutEncoder",
    "cut_basis",
    "cut_half",
    "cut_lr",
    "cut_param_groups",
    "cut_residual",
]


def cut_basis(options: dict[str, Any]) -> torch.Tensor | None:
    """The bottleneck's starting basis from a stage's options: None without ``cut_k``.

    ``cut_basis``: a calibration basis file in this cluster (``[d_model, cut_k]``, the
    principal subspace of real cut activations; both stages are handed the same file);
    empty: the seeded random subspace both sides derive alike (``shared_basis``).
    """
    k = int(options.get("cut_k") or 0)
    if not k:
        return None
    cut_lr(options)  # a bad cut_lr is refused here, at build time, by name
    d_model = int(options["d_model"])
    if options.get("cut_basis"):
        return load_basis_file(str(options["cut_basis"]), d_model, k)
    return shared_basis(d_model, k, int(options.get("cut_seed", 0x4E42)))


def cut_residual(options: dict[str, Any]) -> int | bool:
    """The stage's half's residual path from ``cut_residual``: false (none), true (default width) or a width.

    Refused by name unless a boolean or an integer >= 1 (S: the down-projection's residual, T: the
    up-projection's; docs/codecs.md).
    """
    value = options.get("cut_residual", False)
    if value is None or value == "":
        return False
    if isinstance(value, bool):
        return value
    if not isinstance(value, int) or value < 1:
        raise BottleneckError(
            f"option cut_residual must be false, true or a hidden width >= 1 (e.g. 256), got {value!r}"
        )
    return value


def cut_half(options: dict[str, Any], half: str) -> DownProjection | UpProjection | None:
    """The stage's half of the bottleneck (``half``: "down" in S, "up" in T); None without ``cut_k``.

    Built from the basis (``cut_basis``), with the residual path ``cut_residual`` asks for, then
    loaded from ``cut_init`` when given (a ``save_halves`` file of pre-trained halves,
    ``nebula_common.zoo.bottleneck.calibrate``), refused by name unless it fits.
    """
    basis = cut_basis(options)
    if basis is None:
        return None
    d_model, k, residual = int(options["d_model"]), int(options["cut_k"]), cut_residual(options)
    if half == "down":
        width = (max(4 * k, 16) if residual is True else int(residual)) if residual else 0
        module: DownProjection | UpProjection = DownProjection(d_model, k, basis, residual=width)
    else:
        module = UpProjection(d_model, k, basis, residual=residual)
    if options.get("cut_init"):
        load_half(str(options["cut_init"]), half, module)
    return module


DEFAULT_CUT_LR = 1e-4
"""The bottleneck's own learning rate (docs/codecs.md, "Its learning rate"; Table 5's ``cut_lr``)."""


def cut_lr(options: dict[str, Any]) -> float:
    """The bottleneck's learning rate from a stage's ``cut_lr`` option (absent or empty: 1e-4).

    Refused by name unless a positive finite number: at the adapters' rate the projections
    lose their calibrated subspace, so the stage's own rate is never a silent fallback.
    """
    value = options.get("cut_lr")
    if value is None or value == "":
        return DEFAULT_CUT_LR
    try:
        rate = float(value)
    except (TypeError, ValueError):
        rate = math.nan
    if isinstance(value, bool) or not (rate > 0 and math.isfinite(rate)):
        raise BottleneckError(f"option cut_lr must be a positive learning rate (e.g. 1e-4), got {value!r}")
    return rate


def cut_param_groups(model: nn.Module, options: dict[str, Any]) -> list[dict[str, Any]]:
    """The bottleneck half's parameters in their own optimizer group at ``cut_lr``; [] without one."""
    half = (
        model.down if isinstance(model, CutEncoder) else model.up if isinstance(model, CutDecoder) else None
    )
    if half is None:
        return []
    return [{"params": [p for p in half.parameters() if p.requires_grad], "lr": cut_lr(options)}]


class CutEncoder(nn.Module):
    """Cluster S with a learned bottleneck: the adapter encoder, then ``d -> k`` (only ``k`` crosses)."""

    def __init__(self, encoder: AdapterTransformerEncoder, down: DownProjection) -> None:
        super().__init__()
        self.encoder = encoder
        self.down = down

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.down(self.encoder(ids))


class CutDecoder(nn.Module):
    """Cluster T with a learned bottleneck: ``k -> d`` (optionally plus its residual), then the decoder."""

    def __init__(self, decoder: AdapterTransformerDecoder, up: UpProjection) -> None:
        super().__init__()
        self.decoder = decoder
        self.up = up

    def loss(self, memory: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.decoder.loss(self.up(memory), target)

    def greedy(self, memory: torch.Tensor, max_length: int, **options: Any) -> torch.Tensor:
        """The decoder's greedy decoding (same options) of the up-projected states."""
        with torch.no_grad():
            return self.decoder.greedy(self.up(memory), max_length, **options)
