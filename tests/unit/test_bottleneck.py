"""The learned bottleneck at the cut: shapes, PCA start, zero rows, gradients, checkpoints, the ABNet job."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nebula_common.jobspec import load_spec
from nebula_common.jobspec.builtin import BUILTIN_DIR
from nebula_common.jobspec.reference import build_programs, run_unsplit
from nebula_common.zoo.bottleneck import (
    BottleneckError,
    DownProjection,
    UpProjection,
    calibrate,
    captured_energy,
    principal_basis,
    save_halves,
    shared_basis,
)

SMALL = {
    "steps": 3,
    "data.batch_size": 16,
    **{f"stages.{i}.options.{k}": v for i in (0, 1) for k, v in {"d_model": 32, "n_layers": 1}.items()},
}


def cut(k: int, **more: object) -> dict[str, object]:
    return {**SMALL, **{f"stages.{i}.options.cut_k": k for i in (0, 1)}, **more}


@pytest.fixture(scope="module")
def activations() -> torch.Tensor:
    """Real cut activations: the ABNet encoder stage on real Spanish catalogue lines (random-init PLM)."""
    source, _ = build_programs(load_spec(BUILTIN_DIR / "abnet" / "job.yaml", SMALL))
    examples = source.module.load_examples(source.options)[:64]
    with torch.no_grad():
        return source.forward(source.module.collate(examples))


def test_shapes_and_bad_arguments_are_named() -> None:
    down, up = DownProjection(32, 4), UpProjection(32, 4, residual=True)
    x = torch.randn(3, 5, 32)
    assert down(x).shape == (3, 5, 4) and up(down(x)).shape == (3, 5, 32)
    for bad in (0, 32, 2.5, True):
        with pytest.raises(BottleneckError, match=r"bottleneck rank k must be an integer in 1\.\.31"):
            DownProjection(32, bad)  # type: ignore[arg-type]
    with pytest.raises(BottleneckError, match=r"basis shape \[32, 5\] does not fit d=32, k=4"):
        DownProjection(32, 4, torch.zeros(32, 5))
    with pytest.raises(BottleneckError, match="expected activations of width 32, got 16"):
        down(torch.randn(2, 16))


def test_principal_start_is_the_best_rank_k_reconstruction(activations: torch.Tensor) -> None:
    k = 8
    basis = principal_basis(activations, k)
    assert torch.allclose(basis.T @ basis, torch.eye(k), atol=1e-5)
    down, up = DownProjection(32, k, basis), UpProjection(32, k, basis, residual=True)
    rows = activations.reshape(-1, 32)
    rows = rows[rows.abs().amax(dim=1) > 0]
    with torch.no_grad():
        rebuilt = up(down(rows))
    error = float((rebuilt - rows).norm() / rows.norm())
    s = torch.linalg.svdvals(rows)
    optimum = float(s[k:].pow(2).sum().sqrt() / s.pow(2).sum().sqrt())  # Eckart-Young
    assert error == pytest.approx(optimum, rel=1e-3)
    assert captured_energy(activations, basis) > captured_energy(activations, shared_basis(32, k)) + 0.05


def test_zero_rows_stay_zero_both_ways(activations: torch.Tensor) -> None:
    basis = principal_basis(activations, 4)
    down, up = DownProjection(32, 4, basis), UpProjection(32, 4, basis, residual=True)
    with torch.no_grad():
        up.residual[2].weight.normal_()  # also once the residual has learned something
    x = torch.randn(2, 6, 32)
    x[:, 4:] = 0
    assert (up(down(x))[:, 4:] == 0).all()


def test_the_down_projections_residual_starts_at_zero_and_keeps_zero_rows(activations: torch.Tensor) -> None:
    """``DownProjection(residual=N)``: step 0 is the calibrated subspace; padding stays exactly zero."""
    basis = principal_basis(activations, 4)
    down = DownProjection(32, 4, basis, residual=64)
    x = torch.randn(2, 6, 32)
    x[:, 4:] = 0
    with torch.no_grad():
        torch.testing.assert_close(down(x), x @ basis)  # the residual path is zero at start
        down.residual[2].weight.normal_()  # once it has learned something
        assert (down(x)[:, 4:] == 0).all()
        assert not torch.allclose(down(x)[:, :4], x[:, :4] @ basis)
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(
            BottleneckError, match=r"down-projection's residual width must be an integer >= 0"
        ):
            DownProjection(32, 4, residual=bad)  # type: ignore[arg-type]
    assert UpProjection(32, 4, residual=40).residual[0].out_features == 40  # an explicit width
    assert UpProjection(32, 4, residual=True).residual[0].out_features == 16  # the default max(4k, 16)


def test_gradients_flow_through_both_halves_and_cross_at_width_k() -> None:
    residual = {"stages.0.options.cut_residual": 8, "stages.1.options.cut_residual": True}
    job = load_spec(BUILTIN_DIR / "abnet" / "job.yaml", cut(4, **residual))
    source, target = build_programs(job)
    with torch.no_grad():  # the cross-attention gates start at zero (ABNet: identity at init); open them
        for adapter in target.model.decoder.adapters:
            adapter.gate.fill_(0.5)
    ids = source.module.load_examples(source.options)[:8]
    english = target.module.load_examples(target.options)[:8]
    sent = source.forward(source.module.collate(ids))
    assert sent.shape == (8, 24, 4)  # what crosses: k wide, not d_model
    received = sent.detach().requires_grad_(True)
    loss = target.loss(received, target.module.collate(english))
    loss.backward()
    assert received.grad is not None and received.grad.shape == (8, 24, 4)  # the gradient back: k wide
    sent.backward(received.grad)
    up, down = target.model.up, source.model.down
    for name, parameter in [("up", up.proj.weight), ("down", down.proj.weight)]:
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
    assert up.residual[2].weight.grad.abs().sum() > 0
    assert down.residual[2].weight.grad.abs().sum() > 0 and down.residual[0].out_features == 8
    assert all(p.grad is None for p in source.model.encoder.plm.parameters())  # the PLM stays frozen


def test_bottleneck_parameters_live_in_the_stage_checkpoints(tmp_path: Path) -> None:
    k = 4
    basis = shared_basis(32, k, seed=7)
    path = tmp_path / "basis.pt"
    torch.save(basis, path)
    more = {f"stages.{i}.options.cut_basis": str(path) for i in (0, 1)}
    job = load_spec(BUILTIN_DIR / "abnet" / "job.yaml", cut(k, **more))
    fresh = build_programs(job)
    torch.testing.assert_close(fresh[0].model.down.proj.weight, basis.T)  # started from the given basis
    torch.testing.assert_close(fresh[1].model.up.proj.weight, basis)
    trained = run_unsplit(job).state_dicts
    for stage, key in (("encoder", "down.proj.weight"), ("decoder", "up.proj.weight")):
        assert key in trained[stage]
        assert not torch.equal(
            trained[stage][key], fresh[0 if stage == "encoder" else 1].model.state_dict()[key]
        )
        torch.save(trained[stage], tmp_path / f"{stage}.pt")
    rebuilt = build_programs(job)
    for program, stage in zip(rebuilt, ("encoder", "decoder"), strict=True):
        program.model.load_state_dict(torch.load(tmp_path / f"{stage}.pt", weights_only=True))
        for name, value in program.model.state_dict().items():
            assert torch.equal(value, trained[stage][name]), name


def test_a_basis_that_does_not_fit_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "basis.pt"
    torch.save(torch.zeros(32, 3), path)
    job = load_spec(BUILTIN_DIR / "abnet" / "job.yaml", cut(4, **{"stages.0.options.cut_basis": str(path)}))
    with pytest.raises(BottleneckError, match=r"basis.pt is \[32, 3\], expected \[32, 4\]"):
        build_programs(job)
    missing = load_spec(
        BUILTIN_DIR / "abnet" / "job.yaml",
        cut(4, **{"stages.0.options.cut_basis": str(tmp_path / "nope.pt")}),
    )
    with pytest.raises(BottleneckError, match=r"nope\.pt does not exist in this cluster"):
        build_programs(missing)
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file")
    corrupt = load_spec(
        BUILTIN_DIR / "abnet" / "job.yaml",
        cut(4, **{"stages.0.options.cut_basis": str(tmp_path / "garbage.pt")}),
    )
    with pytest.raises(BottleneckError, match=r"garbage\.pt is not a saved tensor"):
        build_programs(corrupt)


def test_the_bottleneck_trains_at_its_own_learning_rate() -> None:
    """``cut_lr``: the bottleneck's parameters are their own param group; the rest keep the stage's lr."""
    job = load_spec(BUILTIN_DIR / "abnet" / "job.yaml", cut(4, **{"optimizer.lr": 3e-3}))
    for programs, rate in ((build_programs(job), 1e-4), (build_programs(_with_cut_lr(4, 2e-5)), 2e-5)):
        for program, half in zip(programs, ("down", "up"), strict=True):
            lrs = {id(p): g["lr"] for g in program.optimizer.param_groups for p in g["params"]}
            cut_params = [p for p in getattr(program.model, half).parameters() if p.requires_grad]
            others = [
                p for n, p in program.model.named_parameters() if p.requires_grad and not n.startswith(half)
            ]
            assert cut_params and others
            assert {lrs[id(p)] for p in cut_params} == {rate}, half
            assert {lrs[id(p)] for p in others} == {3e-3}, half
            trainable = [p for p in program.model.parameters() if p.requires_grad]
            assert sorted(lrs) == sorted(id(p) for p in trainable)  # each trainable parameter exactly once
    plain = build_programs(load_spec(BUILTIN_DIR / "abnet" / "job.yaml", SMALL))
    assert all(len(p.optimizer.param_groups) == 1 for p in plain)  # without cut_k: one group, as before


def _with_cut_lr(k: int, rate: object) -> object:
    more = {f"stages.{i}.options.cut_lr": rate for i in (0, 1)}
    return load_spec(BUILTIN_DIR / "abnet" / "job.yaml", cut(k, **{"optimizer.lr": 3e-3, **more}))


@pytest.mark.parametrize("bad", [0, -1e-4, "fast", "inf", True])
def test_a_bad_cut_lr_is_refused_by_name(bad: object) -> None:
    with pytest.raises(BottleneckError, match=r"option cut_lr must be a positive learning rate"):
        build_programs(_with_cut_lr(4, bad))


def _job(k: int, **options: object) -> object:
    more = {f"stages.{i}.options.{name}": value for i in (0, 1) for name, value in options.items()}
    return load_spec(BUILTIN_DIR / "abnet" / "job.yaml", cut(k, **more))


def test_calibrated_halves_keep_more_than_the_principal_start_and_load_into_both_stages(
    activations: torch.Tensor, tmp_path: Path
) -> None:
    """``calibrate`` (autoencoder pre-training) + ``save_halves`` -> the job's ``cut_init`` in both stages."""
    k = 4
    down, up, energy = calibrate(activations, k, residual=32, steps=300, seed=0)
    assert energy > captured_energy(activations, principal_basis(activations, k)) + 0.02
    path = tmp_path / "halves.pt"
    save_halves(str(path), down, up)
    source, target = build_programs(_job(k, cut_residual=32, cut_init=str(path)))
    for module, trained in ((source.model.down, down), (target.model.up, up)):
        for name, value in trained.state_dict().items():
            assert torch.equal(module.state_dict()[name], value), name
    x = activations[:2]
    with torch.no_grad():
        torch.testing.assert_close(target.model.up(source.model.down(x)), up(down(x)))
    with pytest.raises(BottleneckError, match=r"halves\.pt: its down half .* does not fit this stage's"):
        build_programs(_job(k, cut_residual=16, cut_init=str(path)))  # saved with width 32
    with pytest.raises(BottleneckError, match=r"nope\.pt does not exist in this cluster"):
        build_programs(_job(k, cut_init=str(tmp_path / "nope.pt")))
    torch.save(torch.zeros(3), tmp_path / "basis.pt")
    with pytest.raises(BottleneckError, match=r"basis\.pt has no 'down' half"):
        build_programs(_job(k, cut_init=str(tmp_path / "basis.pt")))
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file")
    with pytest.raises(BottleneckError, match=r"garbage\.pt is not a saved state"):
        build_programs(_job(k, cut_init=str(tmp_path / "garbage.pt")))


@pytest.mark.parametrize("bad", [0, -8, "wide", 2.5])
def test_a_bad_cut_residual_is_refused_by_name(bad: object) -> None:
    with pytest.raises(
        BottleneckError, match=r"option cut_residual must be false, true or a hidden width >= 1"
    ):
        build_programs(_job(4, cut_residual=bad))
