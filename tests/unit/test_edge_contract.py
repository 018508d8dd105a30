"""Edge behaviours every transport must keep: order, signals, exact integers, close, credit.

Parametrized over the in-memory pair and pairs through two real mTLS switches (clusters a and b, each
with its own auth server; a dials b): on OpenEdge streams (``grpc``) and as records on the switches'
edge sockets, through a trainer's tickets and passed descriptors: plain on Unix sockets (``records``)
and sealed on TCP edge ports after mutual TLS 1.3, internal TLS on (``records-tls``). Link cuts are not
tested over the switches here: the switch that sends LinkNotice lands separately.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from nebula_common.proto.nebula.v1 import relay_pb2
from services.trainer.edge import (
    EdgeClosedError,
    EdgeConnection,
    EdgeRestartRequired,
    EdgeSettings,
)
from services.trainer.edge.memory import MemoryLink
from tests.support import edges as edge_support
from tests.support.edges import SwitchPair, memory_pair, wait_for

pytestmark = pytest.mark.timeout(120)

Pair = Callable[..., tuple[EdgeConnection, EdgeConnection]]
SETTINGS = EdgeSettings(window_bytes=1 << 20, max_outage_s=30, retransmit_s=1.0, ready_timeout_s=30)
READY, SYNC, EVAL_DONE, RESUME = (
    relay_pb2.SIGNAL_KIND_READY,
    relay_pb2.SIGNAL_KIND_SYNC,
    relay_pb2.SIGNAL_KIND_EVAL_DONE,
    relay_pb2.SIGNAL_KIND_RESUME,
)
_jobs = itertools.count()
CARRIERS = ["memory", "grpc", "records", "records-tls"]


def _switches(request: pytest.FixtureRequest) -> tuple[SwitchPair, str]:
    """The switch pair of a carrier and the carrier its transports take."""
    if request.param == "records-tls":
        return request.getfixturevalue("tls_switches"), "records"
    return request.getfixturevalue("switches"), request.param


@pytest.fixture(params=CARRIERS)
def open_pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    opened: list[EdgeConnection] = []

    def make(settings: EdgeSettings = SETTINGS, **codecs: str) -> tuple[EdgeConnection, EdgeConnection]:
        if request.param == "memory":
            pair = memory_pair(MemoryLink(max_window_bytes=settings.window_bytes), settings, **codecs)
        else:
            switches, carrier = _switches(request)
            pair = switches.edge_pair(f"contract-{next(_jobs)}", settings, **codecs, carrier=carrier)
        opened.extend(pair)
        return pair

    yield make
    for edge in opened:
        edge.abort("test over")


def close_both(up: EdgeConnection, down: EdgeConnection) -> None:
    closer = threading.Thread(target=down.close, daemon=True)
    closer.start()
    up.close()
    closer.join(30)
    assert not closer.is_alive()


def test_tensors_and_signals_arrive_in_order_and_signals_exactly(open_pair: Pair) -> None:
    up, down = open_pair()
    down.send_signal(READY, 0)
    assert up.receive_signal(READY, 0, timeout=30) == []
    for step in range(5):
        for micro_batch in range(3):
            up.send_tensor(torch.full((4, 8), step * 10.0 + micro_batch), step, micro_batch)
        down.send_signal(SYNC, step, [step + 0.1, 1e300, -2.5e-300])
    for step in range(5):
        for micro_batch in range(3):
            got = down.receive_tensor(step, micro_batch, timeout=30)
            assert torch.equal(got, torch.full((4, 8), step * 10.0 + micro_batch))
        assert up.receive_signal(SYNC, step, timeout=30) == [step + 0.1, 1e300, -2.5e-300]
    down.send_signal(EVAL_DONE, 5, [3.0])
    with pytest.raises(EdgeClosedError, match="schedule mismatch: expected SIGNAL_KIND_SYNC"):
        up.receive_signal(SYNC, 5, timeout=30)
    close_both(up, down)


def test_a_tensor_of_many_chunks_arrives_exactly_and_plain_records_place_it_without_a_copy(
    open_pair: Pair, request: pytest.FixtureRequest
) -> None:
    up, down = open_pair()
    generator = torch.Generator().manual_seed(5)
    tensors = [torch.randn(3, 1 << 18, generator=generator) for _ in range(3)]  # 3 MiB: 12 chunks each
    for micro_batch, tensor in enumerate(tensors):
        up.send_tensor(tensor, 0, micro_batch)
    for micro_batch, tensor in enumerate(tensors):
        assert torch.equal(down.receive_tensor(0, micro_batch, timeout=30), tensor)
    placed = getattr(down.session.transport, "placed_bytes", None)
    if request.node.callspec.params["open_pair"] == "records":
        # Each payload chunk read straight into its frame's buffer: the receiver copies no payload byte.
        # A chunk the sender retransmitted (its acknowledgement late on a busy machine) is placed again.
        assert placed is not None and placed >= sum(t.numel() * 4 for t in tensors), placed
    close_both(up, down)


def test_integer_tensors_travel_exactly_whatever_the_float_codec(open_pair: Pair) -> None:
    up, down = open_pair(codec_forward="int8")
    ids = torch.tensor([[0, 1, 2**24 + 1, 2**53 + 1], [-(2**62), 2**62 + 7, -1, 12345678901234]])
    floats = torch.linspace(-1, 1, 64).reshape(8, 8)
    up.send_tensor(ids, 0, 0)
    up.send_tensor(floats, 0, 1)
    got = down.receive_tensor(0, 0, timeout=30)
    assert got.dtype == torch.int64 and torch.equal(got, ids)
    lossy = down.receive_tensor(0, 1, timeout=30)
    assert not torch.equal(lossy, floats)  # the float codec (int8) did apply to floats
    torch.testing.assert_close(lossy, floats, atol=0.02, rtol=0)
    close_both(up, down)


def test_close_and_abort_reach_the_peer(open_pair: Pair) -> None:
    up, down = open_pair()
    up.send_tensor(torch.ones(3), 0, 0)
    closer = threading.Thread(target=up.close, args=("finished",), daemon=True)
    closer.start()
    assert torch.equal(down.receive_tensor(0, 0, timeout=30), torch.ones(3))  # queued items first ...
    with pytest.raises(EdgeClosedError, match="finished"):
        down.receive_tensor(1, 0, timeout=30)  # ... then the close
    down.close()
    closer.join(30)

    up, down = open_pair()
    down.abort("out of memory")
    with pytest.raises(EdgeClosedError, match="peer side failed: out of memory"):
        up.receive_tensor(0, 0, timeout=30)


def test_credit_is_never_exceeded_with_a_slow_receiver(open_pair: Pair) -> None:
    settings = EdgeSettings(
        window_bytes=1 << 20, max_outage_s=30, retransmit_s=5.0, ready_timeout_s=30, receive_queue_items=2
    )
    up, down = open_pair(settings)
    tensors = [torch.full((256, 256), float(i)) for i in range(12)]  # 256 KiB each, 3 MiB in all
    errors: list[BaseException] = []

    def send_all() -> None:
        try:
            for i, tensor in enumerate(tensors):
                up.send_tensor(tensor, i, 0)
        except BaseException as exc:
            errors.append(exc)

    sender = threading.Thread(target=send_all, daemon=True)
    sender.start()
    # The receiver reads nothing yet: its queue fills, it stops granting, and the sender stalls.
    wait_for(lambda: len(down.session._queue) >= 2, 30, "the receiver's queue to fill")
    wait_for(lambda: sender.is_alive() and up.session.link_up, 30, "the sender to be held back")
    received_bytes = down.session._held_bytes
    assert received_bytes < sum(t.numel() * 4 for t in tensors)  # not everything was pushed through
    for i, tensor in enumerate(tensors):
        assert torch.equal(down.receive_tensor(i, 0, timeout=30), tensor)
    sender.join(30)
    assert not errors, errors
    assert down.session.max_over_grant_bytes <= 0  # never a byte beyond the absolute credit
    close_both(up, down)


def test_a_header_above_max_frame_bytes_fails_the_edge() -> None:
    link = MemoryLink()
    small = EdgeSettings(max_frame_bytes=1 << 20, ready_timeout_s=10)
    big = EdgeSettings(max_frame_bytes=1 << 30, ready_timeout_s=10)
    ends: dict[int, EdgeConnection] = {}

    def open_end(index: int) -> None:
        ends[index] = EdgeConnection(
            link.ends[index], job_id="j", edge="e", upstream=index == 0, settings=big if index == 0 else small
        )

    threads = [threading.Thread(target=open_end, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    up, down = ends[0], ends[1]
    up.send_tensor(torch.zeros(300_000), 0, 0)  # 1.2 MB
    with pytest.raises(
        EdgeClosedError, match=r"announced a tensor of 1200000 bytes .* max_frame_bytes 1048576"
    ):
        down.receive_tensor(0, 0, timeout=10)
    with pytest.raises(EdgeClosedError, match=r"peer side failed: .*max_frame_bytes"):
        up.receive_tensor(0, 0, timeout=10)


@pytest.fixture(params=CARRIERS)
def open_end(request: pytest.FixtureRequest) -> Iterator[Callable[[int, int], EdgeConnection]]:
    """``open_end(index, epoch)``: one end of this test's edge (0 upstream, 1 downstream) in ``epoch``."""
    opened: list[EdgeConnection] = []
    job = f"epochs-{next(_jobs)}"
    link = MemoryLink(max_window_bytes=SETTINGS.window_bytes)
    switches, carrier = _switches(request) if request.param != "memory" else (None, "")

    def make(index: int, epoch: int) -> EdgeConnection:
        if switches is None:
            transport: object = link.ends[index] if epoch == 0 else link.open_end(index, epoch)
        else:
            transport = switches.transport(carrier, index, job, "up->down", epoch)
        edge = EdgeConnection(
            transport,  # type: ignore[arg-type]
            job_id=job,
            edge="up->down",
            upstream=index == 0,
            settings=SETTINGS,
            epoch=epoch,
        )
        opened.append(edge)
        return edge

    yield make
    for edge in opened:
        edge.abort("test over")


def test_a_vanished_end_reopened_in_a_new_epoch_restarts_the_survivor(
    open_end: Callable[[int, int], EdgeConnection],
) -> None:
    """A dead trainer (no close) comes back at epoch 1: the survivor is told, both exchange RESUME."""
    up, down = edge_support.open_pair(lambda index: open_end(index, 0))
    up.send_tensor(torch.ones(2), 0, 0)
    assert torch.equal(down.receive_tensor(0, 0, timeout=30), torch.ones(2))
    down.session.transport.shutdown()  # the process died: its stream ends without a close
    raised: list[BaseException] = []

    def survivor() -> None:
        try:
            up.receive_tensor(0, 0, timeout=60)
        except BaseException as exc:
            raised.append(exc)

    waiting = threading.Thread(target=survivor, daemon=True)
    waiting.start()
    new_down = open_end(1, 1)
    new_down.send_signal(RESUME, 1, [2.0, 4.0])
    waiting.join(30)
    assert len(raised) == 1 and isinstance(raised[0], EdgeRestartRequired), raised
    assert raised[0].epoch == 1
    new_up = open_end(0, 1)
    assert new_up.receive_signal(RESUME, 1, timeout=30) == [2.0, 4.0]
    new_up.send_signal(RESUME, 1, [4.0])
    assert new_down.receive_signal(RESUME, 1, timeout=30) == [4.0]
    new_up.send_tensor(torch.full((2,), 7.0), 4, 0)  # the new epoch's sequence starts afresh
    assert torch.equal(new_down.receive_tensor(4, 0, timeout=30), torch.full((2,), 7.0))
    close_both(new_up, new_down)
