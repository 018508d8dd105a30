"""Time a job's stages on one micro-batch in the submitter: what ``auto`` predicts step times from.

The probe runs the job's own stage programs here, every cut as the split run has it (a detached
leaf on the far side), so it measures each stage's forward and backward and each edge's tensor
shape without any cluster. The trainers compute on one intra-op thread by default, and so does
the probe.

Each span is the probing thread's CPU time (``time.thread_time``), not the wall clock: the probe runs
while the switches measure the link and, on a shared host, beside whatever else runs there, and a wall
clock would count the waits for a core as the job's compute (2.5-3.5x with every core busy,
``tests/unit/test_job_probe.py``). With one intra-op thread, torch's forward and the autograd engine's
CPU backward both run on the calling thread, so its CPU time is the compute.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from nebula_common.jobspec.reference import build_programs
from nebula_common.jobspec.runtime import example_ids
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.step_model import StageTimes

PROBE_REPEATS = 3
"""Timed micro-batches of the probe (after one untimed warm-up); each part's median is kept."""


@dataclass(frozen=True)
class MicroBatchProbe:
    activation_shape: tuple[int, ...]
    compute_seconds: float
    """One micro-batch of every stage, one after the other (what an in-process trial step costs)."""
    edge_shapes: tuple[tuple[int, ...], ...] = ()
    """Every edge's activation shape in chain order (the first is ``activation_shape``)."""
    forward_seconds: tuple[float, ...] = ()
    """Per stage, its forward of one micro-batch (the last stage's: forward, loss and backward)."""
    backward_seconds: tuple[float, ...] = ()
    """Per stage but the last, its backward of one micro-batch from the gradient it received."""
    setup_seconds: float = 0.0
    """Building the job's stage programs once more (what each trial run pays before its first step)."""
    samples: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    """Per edge, the job's own activation and its gradient at the cut: what a codec's error is measured
    on (synthetic stand-ins miss the job's structure: a rank-16 approximation kept 98% of a synthetic
    activation of the demo job and 75% of its real one)."""

    def stage_times(self, edge: int = 0) -> StageTimes:
        """The two sides of edge ``edge``: the stages before it as upstream, the rest as downstream."""
        if not self.forward_seconds:  # no split timing given: the compute on one side
            return StageTimes(self.compute_seconds / 2, self.compute_seconds / 2, 0.0)
        up = slice(0, edge + 1)
        down = sum(self.forward_seconds[edge + 1 :]) + sum(self.backward_seconds[edge + 1 :])
        return StageTimes(sum(self.forward_seconds[up]), sum(self.backward_seconds[up]), down)


def probe_micro_batch(job: ProgramJob, repeats: int = PROBE_REPEATS) -> MicroBatchProbe:
    """Time the job's stages on one micro-batch here: each edge's tensor shape and each stage's compute.

    The first run is not timed (torch allocates and initialises lazily, so a cold first
    micro-batch costs many warm ones); each stage's forward and backward is the median of
    ``repeats`` runs after it, in CPU time of one intra-op thread as the trainers compute by default.
    """
    with one_torch_thread():
        return _probe(job, repeats)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one intra-op thread for the block (the trainers' default), then as it was."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _probe(job: ProgramJob, repeats: int) -> MicroBatchProbe:
    spec = job.spec
    build_programs(job.loaded)  # the first build also pays this process's imports
    clock = time.perf_counter()
    programs = build_programs(job.loaded)
    setup = time.perf_counter() - clock
    first, middles, last = programs[0], programs[1:-1], programs[-1]
    size = spec.data.batch_size // spec.data.micro_batches
    ids = example_ids(spec.seed, spec.data.examples, 0, 0, spec.data.micro_batches, size)
    forwards: list[list[float]] = [[] for _ in programs]
    backwards: list[list[float]] = [[] for _ in programs[:-1]]
    shapes: tuple[tuple[int, ...], ...] = ()
    samples: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    for run in range(repeats + 1):
        marks = [time.thread_time()]
        cuts: list[tuple[torch.Tensor, torch.Tensor]] = []
        states = first.forward(first.batch(ids))
        for middle in middles:  # a chain: every cut as the split run has it (a leaf on the far side)
            marks.append(time.thread_time())
            received = states.detach().requires_grad_(True)
            cuts.append((states, received))
            states = middle.relay(received, ids)
        marks.append(time.thread_time())
        received = states.detach().requires_grad_(True)
        cuts.append((states, received))
        last.loss(received, last.batch(ids)).backward()
        marks.append(time.thread_time())
        for sent, leaf in reversed(cuts):  # stage k's backward, from the last cut's sender down
            sent.backward(_grad(leaf))
            marks.append(time.thread_time())
        shapes = tuple(tuple(sent.shape) for sent, _ in cuts)
        samples = tuple((sent.detach(), _grad(leaf)) for sent, leaf in cuts)
        if run == 0:
            continue  # the warm-up
        spans = [later - earlier for earlier, later in itertools.pairwise(marks)]
        for stage in range(len(programs)):
            forwards[stage].append(spans[stage])
        for stage, seconds in enumerate(reversed(spans[len(programs) :])):
            backwards[stage].append(seconds)
    forward = tuple(statistics.median(each) for each in forwards)
    backward = tuple(statistics.median(each) for each in backwards)
    return MicroBatchProbe(
        activation_shape=shapes[0],
        compute_seconds=sum(forward) + sum(backward),
        edge_shapes=shapes,
        forward_seconds=forward,
        backward_seconds=backward,
        setup_seconds=setup,
        samples=samples,
    )


def _grad(leaf: torch.Tensor) -> torch.Tensor:
    """The gradient the far side sent back for a cut (zeros where the loss did not depend on it)."""
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
