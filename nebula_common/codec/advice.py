"""Codec advice: rank codec specs for a link and a job's tensors by predicted step time.

The step-time model is deliberately simple and stated here so its predictions can
be checked: per optimizer step, each direction costs ``per_step`` tensors x
(encode + bytes * 8 / bandwidth + decode) plus half the RTT, and the step is the
compute time plus the sum over directions. It ignores overlap of compute with
transfer (pessimistic for pipelined micro-batches) but ranks specs correctly
whenever the WAN dominates, which is the case the advice exists for.

Per candidate: the ratio is exact (``encoded_size``) for fixed-size codecs and
measured for zstd; the error is measured by actually encoding and decoding a
sample tensor (the caller's, or synthetic activation-like / gradient-like data of
the same shape); encode/decode seconds come from the host calibration
(``calibration.Calibrator``), never from constants. Options within the error
budget rank before those over it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from nebula_common.codec.base import CodecError, dtype_from_name, matrix_view, numel, reconstruction_error
from nebula_common.codec.calibration import Calibrator
from nebula_common.codec.registry import get_codec
from nebula_common.codec.row_elision import pack, zero_rows

FORWARD = "forward"
BACKWARD = "backward"
DEFAULT_BUDGET = {FORWARD: 0.10, BACKWARD: 0.25}
"""Relative L2 error budgets when the request gives none. Activations feed the next stage as they are, so
theirs is tighter. Chosen on Table 5's translation cut (``docs/bench/table5.md``): 8% forward cost 1.3% of
none's BLEU on dev (2 seeds), the 8% / 25% row 2.5% on test (5 seeds), int4's 11.6% 4.4% on dev, all
inside a 5% quality budget. Gradient
noise of 25% is averaged out by SGD-like optimizers (the paper ran INT8 gradients). A job's trial still
rejects a pair whose loss falls behind ``none``'s."""
DEFAULT_TOP_N = 8
MAX_ERROR_ELEMENTS = 1 << 20
"""Synthetic error samples larger than this are cut to fewer rows, keeping the row width."""


@dataclass
class EdgeTensor:
    """One tensor that crosses the link per micro-batch."""

    edge: str
    direction: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    per_step: int = 1
    sample: torch.Tensor | None = None


@dataclass
class AdviceRequest:
    """What the advisor needs: the link, the tensors, compute time and an error budget."""

    bandwidth_bps: float
    rtt_seconds: float
    tensors: list[EdgeTensor]
    compute_seconds: float = 0.0
    error_budget: float = 0.0
    candidates: list[str] = field(default_factory=list)
    top_n: int = DEFAULT_TOP_N

    def validate(self) -> None:
        if not (self.bandwidth_bps > 0 and math.isfinite(self.bandwidth_bps)):
            raise CodecError(f"bandwidth_bps must be a positive number, got {self.bandwidth_bps!r}")
        if not (self.rtt_seconds >= 0 and math.isfinite(self.rtt_seconds)):
            raise CodecError(f"rtt_seconds must be >= 0, got {self.rtt_seconds!r}")
        if not (self.compute_seconds >= 0 and math.isfinite(self.compute_seconds)):
            raise CodecError(f"compute_seconds must be >= 0, got {self.compute_seconds!r}")
        if not (self.error_budget >= 0 and math.isfinite(self.error_budget)):
            raise CodecError(f"error_budget must be >= 0, got {self.error_budget!r}")
        if not self.tensors:
            raise CodecError("tensors: give at least one edge tensor to advise on")
        for tensor in self.tensors:
            if tensor.direction not in (FORWARD, BACKWARD):
                raise CodecError(f"tensors: direction must be forward or backward, got {tensor.direction!r}")
            dtype_from_name(tensor.dtype)
            if any(dim < 0 for dim in tensor.shape) or numel(tensor.shape) > (1 << 28):
                raise CodecError(f"tensors: shape {list(tensor.shape)} is invalid or too large to advise on")
            if tensor.sample is not None and tuple(tensor.sample.shape) != tuple(tensor.shape):
                raise CodecError(
                    f"tensors: sample of shape {list(tensor.sample.shape)} does not match "
                    f"{list(tensor.shape)}"
                )


@dataclass
class Option:
    """One ranked codec spec for one direction, with everything the prediction used."""

    spec: str
    ratio: float
    encoded_bytes: int
    rel_error: float
    encode_seconds: float
    decode_seconds: float
    transfer_seconds: float
    direction_seconds: float
    within_budget: bool
    note: str = ""


@dataclass
class DirectionAdvice:
    edge: str
    direction: str
    shape: tuple[int, ...]
    options: list[Option]
    error_source: str
    error_budget: float
    baseline_seconds: float = 0.0
    """This direction's predicted seconds with ``none``, for comparison."""

    @property
    def best(self) -> Option:
        return self.options[0]


@dataclass
class AdviceResult:
    """Ranked options per direction and the resulting step-time prediction."""

    directions: list[DirectionAdvice]
    predicted_step_seconds: float
    baseline_step_seconds: float
    calibration_host: str = ""
    calibrated_at: float = 0.0
    calibration_cached: bool = False

    def best(self, direction: str, edge: str | None = None) -> str:
        """The top-ranked spec for ``direction`` (``"forward"``/``"backward"``), optionally of one edge."""
        for advice in self.directions:
            if advice.direction == direction and (edge is None or advice.edge == edge):
                return advice.best.spec
        raise KeyError(f"no advice for direction {direction!r}" + (f" on edge {edge!r}" if edge else ""))

    @property
    def forward_spec(self) -> str:
        return self.best(FORWARD)

    @property
    def backward_spec(self) -> str:
        return self.best(BACKWARD)


BUDGET_TARGETS = (0.8, 0.5)
"""``zstd(int8(error=f * budget))`` for each f: quantization aimed just inside the direction's budget (the
achieved error varies a little with the data; the sample's measured error decides) and one with margin."""


def default_candidates(shape: Sequence[int], direction: str, budget: float = 0.0) -> list[str]:
    """Specs worth comparing for ``shape``: quantizers, zstd, top-k for gradients, low rank where it pays,
    and, given the direction's error ``budget``, entropy-coded quantization spending just that error."""
    specs = ["none", "fp16", "bf16", "int8", "int8(scale=row)", "int8(scale=block)"]
    specs += ["int4", "zstd(int8)", "zstd(int4)"]
    if budget > 0:
        specs += [f"zstd(int8(error={min(1.0, round(f * budget, 4)):g}))" for f in BUDGET_TARGETS]
    if direction == BACKWARD:
        specs += ["fp16(topk(0.1))", "int8(topk(0.05))"]
    view = matrix_view(shape)
    if view is not None:
        m, n = view
        pays = m * n / (m + n)
        for rank in (4, 8, 16, 32, 64, 128):
            if rank < pays / 2 and rank < min(m, n):
                specs += [f"fp16(lowrank({rank}))", f"int8(powersgd({rank}))"]
        if min(m, n) <= 1024:  # a full SVD of anything larger is never competitive
            specs += [f"fp16(svd({ratio}))" for ratio in (0.2, 0.4, 0.6, 0.8)]
    return specs


def job_advice_request(
    *,
    bandwidth_bps: float,
    rtt_seconds: float,
    edge: str,
    activation_shape: Sequence[int],
    gradient_shape: Sequence[int] | None = None,
    micro_batches: int = 1,
    compute_seconds: float = 0.0,
    error_budget: float = 0.0,
    dtype: str = "float32",
    samples: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> AdviceRequest:
    """The request for a two-stage job: one activation (forward) and one gradient (backward) tensor per
    micro-batch on ``edge``; the gradient has the activation's shape unless given. ``samples``: the
    job's own (activation, gradient), to measure each codec's error on instead of synthetic data."""
    shape = tuple(int(dim) for dim in activation_shape)
    grad = tuple(int(dim) for dim in gradient_shape) if gradient_shape is not None else shape
    forward_sample, backward_sample = samples if samples is not None else (None, None)
    return AdviceRequest(
        bandwidth_bps=bandwidth_bps,
        rtt_seconds=rtt_seconds,
        compute_seconds=compute_seconds,
        error_budget=error_budget,
        tensors=[
            EdgeTensor(edge, FORWARD, shape, dtype, micro_batches, forward_sample),
            EdgeTensor(edge, BACKWARD, grad, dtype, micro_batches, backward_sample),
        ],
    )


def synthetic_sample(
    shape: tuple[int, ...], direction: str, max_elements: int | None = MAX_ERROR_ELEMENTS
) -> torch.Tensor:
    """Deterministic stand-in data: activations are low-rank plus noise with outlier channels,
    gradients are heavy-tailed (a Gaussian scale mixture). Large shapes are cut to fewer rows."""
    dims = list(shape)
    if max_elements is not None and numel(dims) > max_elements and len(dims) >= 2:
        width = numel(dims[1:])
        dims[0] = max(1, max_elements // max(1, width))
    generator = torch.Generator().manual_seed(20240531)
    view = matrix_view(dims)
    if view is None:
        return torch.randn(dims, generator=generator)
    m, n = view
    if direction == BACKWARD:
        scale = torch.exp(torch.randn(m, n, generator=generator))
        return (torch.randn(m, n, generator=generator) * scale * 1e-3).reshape(dims)
    rank = max(1, min(m, n) // 8)
    spectrum = torch.logspace(0, -1.5, rank).unsqueeze(1)
    data = torch.randn(m, rank, generator=generator) @ (torch.randn(rank, n, generator=generator) * spectrum)
    data += 0.05 * torch.randn(m, n, generator=generator)
    outliers = torch.randperm(n, generator=generator)[: max(1, n // 64)]
    data[:, outliers] *= 10.0
    return data.reshape(dims)


def advise(request: AdviceRequest, calibrator: Calibrator) -> AdviceResult:
    """Rank candidates per edge direction; see the module docstring for the model."""
    request.validate()
    calibration = calibrator.get()
    directions: list[DirectionAdvice] = []
    step = baseline = request.compute_seconds * max(max(t.per_step, 1) for t in request.tensors)
    for tensor in request.tensors:
        advice = _advise_one(request, tensor, calibrator)
        directions.append(advice)
        step += advice.best.direction_seconds
        baseline += advice.baseline_seconds
    return AdviceResult(
        directions=directions,
        predicted_step_seconds=step,
        baseline_step_seconds=baseline,
        calibration_host=calibration.host,
        calibrated_at=calibration.created,
        calibration_cached=calibration.cached,
    )


def _advise_one(request: AdviceRequest, tensor: EdgeTensor, calibrator: Calibrator) -> DirectionAdvice:
    budget = request.error_budget or DEFAULT_BUDGET[tensor.direction]
    dtype = dtype_from_name(tensor.dtype)
    sample = tensor.sample
    source = "sample"
    if sample is None:
        sample = synthetic_sample(tensor.shape, tensor.direction).to(dtype)
        source = "synthetic"
    candidates = request.candidates or default_candidates(tensor.shape, tensor.direction, budget)
    options: list[Option] = []
    seen: set[str] = set()
    for text in candidates:
        codec = get_codec(text)
        if not codec.wire:
            raise CodecError(f"candidates: {codec.spec!r} is a stream option, not a wire codec")
        if codec.spec in seen:
            continue
        seen.add(codec.spec)
        options.append(_score(request, tensor, codec.spec, sample, calibrator, budget))
    options.sort(key=lambda o: (not o.within_budget, o.direction_seconds, o.rel_error))
    top_n = request.top_n or DEFAULT_TOP_N
    baseline = next((o for o in options if o.spec == "none"), None)
    if baseline is None:
        baseline = _score(request, tensor, "none", sample, calibrator, budget)
    ranked = options[:top_n]
    if all(o.spec != "none" for o in ranked):
        # A caller prices "none" as the baseline from these options: what it would really send (padding
        # rows left out), not the dense tensor's bytes.
        ranked.append(baseline)
    return DirectionAdvice(
        edge=tensor.edge,
        direction=tensor.direction,
        shape=tuple(tensor.shape),
        options=ranked,
        error_source=source,
        error_budget=budget,
        baseline_seconds=baseline.direction_seconds,
    )


def _score(
    request: AdviceRequest,
    tensor: EdgeTensor,
    spec: str,
    sample: torch.Tensor,
    calibrator: Calibrator,
    budget: float,
) -> Option:
    codec = get_codec(spec)
    dtype = dtype_from_name(tensor.dtype)
    shape = tuple(tensor.shape)
    raw = numel(shape) * torch.empty((), dtype=dtype).element_size()
    # The stream leaves the sample's zero rows (padding) out of the payload: score what it will send.
    rows = zero_rows(sample)
    coded = sample if rows is None else pack(sample, rows)
    payload = codec.encode(coded)
    decoded = codec.decode(payload, tuple(coded.shape), coded.dtype)
    error = reconstruction_error(coded, decoded)["rel_l2"]  # the rows left out come back exactly
    sent_shape = shape
    bitmap = 0
    if rows is not None and len(shape) >= 2 and shape[-1]:
        whole_rows = numel(shape) // shape[-1]
        kept = coded.shape[0] / rows.present.numel()
        sent_shape = (max(1, round(kept * whole_rows)), shape[-1])
        bitmap = -(-whole_rows // 8)
    if codec.variable_size:
        coded_raw = coded.numel() * coded.element_size()
        sent_raw = numel(sent_shape) * torch.empty((), dtype=dtype).element_size()
        encoded = math.ceil(sent_raw * (len(payload) / coded_raw)) + bitmap if coded_raw else 0
    else:
        encoded = codec.encoded_size(sent_shape, dtype) + bitmap
    encode_s, decode_s = calibrator.predict(spec, sent_shape, dtype)
    transfer = encoded * 8 / request.bandwidth_bps
    per_step = max(tensor.per_step, 1)
    seconds = per_step * (encode_s + transfer + decode_s) + request.rtt_seconds / 2
    return Option(
        spec=codec.spec,
        ratio=encoded / raw if raw else 0.0,
        encoded_bytes=encoded,
        rel_error=error,
        encode_seconds=encode_s,
        decode_seconds=decode_s,
        transfer_seconds=transfer,
        direction_seconds=seconds,
        within_budget=error <= budget,
        note=codec.plan_note(sent_shape, dtype),
    )
