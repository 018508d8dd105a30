"""The sender's retransmit timeout follows measured RTT and throughput, on a fake clock.

Timers are driven explicitly (``poll_timers`` after moving the fake clock); the session's own
timer thread reads the same clock, so it can only do what ``poll_timers`` would.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import pytest
import torch

from nebula_common.codec import EncodedTensor, TensorStreamEncoder
from nebula_common.proto.nebula.v1 import relay_pb2, tensor_pb2
from services.trainer.edge import EdgeSettings
from services.trainer.edge.session import EdgeSession, RetransmitTimer, TransportHandler
from tests.support.clock import FakeClock
from tests.unit.test_edge_session import ScriptedTransport, ack

pytestmark = pytest.mark.timeout(60)
FORWARD, BACKWARD = tensor_pb2.DIRECTION_FORWARD, tensor_pb2.DIRECTION_BACKWARD
SETTINGS = EdgeSettings(
    window_bytes=1 << 20, retransmit_s=30.0, min_retransmit_s=1.0, max_outage_s=30.0, ready_timeout_s=5
)
PLENTY = 1 << 30  # credit that never limits these tests


def tensor_builder(values: int) -> Callable[[int], EncodedTensor]:
    def build(frame_id: int) -> EncodedTensor:
        return TensorStreamEncoder("none").encode(
            torch.arange(values, dtype=torch.float32), step=0, direction=FORWARD, frame_id=frame_id
        )

    return build


class Sender:
    """A sending session on a scripted transport and a fake clock; the test plays the peer."""

    def __init__(self, settings: EdgeSettings = SETTINGS) -> None:
        self.clock = FakeClock()
        self.transport = ScriptedTransport()
        self.session = EdgeSession(self.transport, FORWARD, settings, clock=self.clock)
        self.session.start()
        self.seq = 0
        self.transport.deliver(ack(0, PLENTY))
        self.transport.take()

    def signal(self) -> int:
        self.session.enqueue_signal(relay_pb2.SIGNAL_KIND_SYNC, 0)
        self.seq += 1
        return self.seq

    def tensor(self, values: int) -> int:
        self.session.enqueue_tensor(tensor_builder(values))
        self.seq += 1
        return self.seq

    def round_trip(self, rtt: float) -> None:
        seq = self.signal()
        self.clock.advance(rtt)
        self.transport.deliver(ack(seq, PLENTY))

    def wait(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.session.poll_timers()


def rfc6298(samples: list[float]) -> tuple[float, float]:
    srtt, rttvar = samples[0], samples[0] / 2
    for r in samples[1:]:
        rttvar = 0.75 * rttvar + 0.25 * abs(srtt - r)
        srtt = 0.875 * srtt + 0.125 * r
    return srtt, rttvar


def test_before_any_sample_the_timeout_is_the_cap_and_then_it_follows_the_samples() -> None:
    s = Sender()
    assert s.session.retransmit_timeout() == 30.0
    samples = [2.0, 2.5, 1.5, 2.0, 2.2]
    for rtt in samples:
        s.round_trip(rtt)
    srtt, rttvar = rfc6298(samples)
    got_srtt, got_rttvar, throughput = s.session.rtt_estimate()
    assert got_srtt == pytest.approx(srtt) and got_rttvar == pytest.approx(rttvar)
    assert throughput is not None and throughput > 0
    assert s.session.retransmit_timeout() == pytest.approx(srtt + 4 * rttvar)  # nothing in flight
    slower = [6.0] * 6
    for rtt in slower:
        s.round_trip(rtt)
    srtt2, rttvar2 = rfc6298(samples + slower)
    assert s.session.retransmit_timeout() == pytest.approx(srtt2 + 4 * rttvar2)
    assert srtt2 + 4 * rttvar2 > srtt + 4 * rttvar


def test_karn_a_replayed_item_gives_no_rtt_sample() -> None:
    s = Sender()
    s.round_trip(0.1)
    s.transport.take()
    seq = s.signal()
    s.clock.advance(0.5)  # below the 1 s RTO: only the peer's resume ack replays it
    s.transport.deliver(ack(seq - 1, PLENTY, resume=True))
    assert s.session.retransmitted_messages == 1
    assert [m.signal.seq for m in s.transport.take("signal")] == [seq, seq]
    s.clock.advance(0.5)
    s.transport.deliver(ack(seq, PLENTY))
    srtt, _, _ = s.session.rtt_estimate()
    assert srtt == pytest.approx(0.1)  # neither 1 s (first send) nor 0.5 s (replay) was sampled
    s.round_trip(0.3)
    assert s.session.rtt_estimate()[0] == pytest.approx(rfc6298([0.1, 0.3])[0])


def test_the_throughput_term_grows_with_the_bytes_in_flight() -> None:
    s = Sender()
    seq = s.tensor(128 * 1024)  # 512 KiB
    s.clock.advance(1.0)
    s.transport.deliver(ack(seq, PLENTY))
    s.transport.take()
    _, _, throughput = s.session.rtt_estimate()
    assert throughput is not None and 400_000 < throughput < 600_000  # ~512 KiB in 1 s
    idle = s.session.retransmit_timeout()
    s.tensor(64 * 1024)  # 256 KiB in flight
    quarter = s.session.retransmit_timeout()
    s.tensor(192 * 1024)  # 1 MiB in flight
    full = s.session.retransmit_timeout()
    in_flight = sum(m.frame.ByteSize() for m in s.transport.take("frame"))
    assert idle < quarter < full
    assert full == pytest.approx(idle + in_flight / throughput)


def test_the_timeout_is_clamped_between_the_floor_and_the_cap_and_backs_off() -> None:
    fast = Sender()
    for _ in range(5):
        fast.round_trip(0.001)
    assert fast.session.retransmit_timeout() == 1.0
    slow = Sender()
    for _ in range(3):
        slow.round_trip(50.0)
    assert slow.session.retransmit_timeout() == 30.0
    # A floor above the cap (tests shrink the cap) yields the cap.
    assert RetransmitTimer(floor=1.0, cap=0.3).rto(0) == 0.3
    timer = RetransmitTimer(floor=1.0, cap=0.3)
    timer.sample(0.01, 100, 0.01)
    assert timer.rto(10**9) == 0.3
    # Consecutive timeouts double it; progress resets it.
    fast.signal()
    fast.wait(1.01)
    assert fast.session.retransmitted_messages == 1
    assert fast.session.retransmit_timeout() == pytest.approx(2.0)
    fast.wait(2.01)
    assert fast.session.retransmit_timeout() == pytest.approx(4.0)
    fast.transport.deliver(ack(fast.seq, PLENTY))
    assert fast.session.retransmit_timeout() == 1.0


def test_a_lost_item_is_resent_after_about_the_measured_rto_not_the_cap(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s = Sender()
    for _ in range(5):
        s.round_trip(0.1)
    assert s.session.retransmit_timeout() == 1.0  # the floor: srtt 0.1 s
    s.transport.take()
    s.wait(100.0)  # idle: an old last ack must not make the next item time out at once
    seq = s.signal()  # lost in flight: never acknowledged
    assert [m.signal.seq for m in s.transport.take("signal")] == [seq]
    s.wait(0.9)
    assert s.transport.take("signal") == [] and s.session.retransmitted_messages == 0
    with caplog.at_level(logging.INFO, logger="services.trainer.edge.replay"):
        s.wait(0.2)
    assert [m.signal.seq for m in s.transport.take("signal")] == [seq]
    (record,) = [r for r in caplog.records if "retransmit timeout" in r.getMessage()]
    fields = record.fields  # type: ignore[attr-defined]
    assert fields["rto_s"] == 1.0 and fields["srtt_s"] == pytest.approx(0.1, abs=1e-3)
    assert fields["inflight_bytes"] > 0


def test_after_a_timeout_a_resume_ack_does_not_rewind_the_replay_until_it_had_time_to_arrive() -> None:
    s = Sender()
    seq = s.tensor(64 * 1024)  # 256 KiB in 1 s: ~256 KiB/s
    s.clock.advance(1.0)
    s.transport.deliver(ack(seq, PLENTY))
    big = s.tensor(256 * 1024)  # 1 MiB: ~4 s at the measured throughput
    s.transport.take()
    rto = s.session.retransmit_timeout()
    assert rto > 4.0
    s.wait(rto + 0.01)  # lost: rewind once
    replayed = len(s.transport.take("frame"))
    assert replayed == 5 and s.session.retransmitted_messages == 5
    # The receiver restarts on the replayed header, sees the original chunks as a gap and asks for
    # a rewind: the replay is still on the wire, so this is not honoured...
    s.wait(1.0)
    s.transport.deliver(ack(big - 1, PLENTY, resume=True))
    assert s.transport.take("frame") == [] and s.session.retransmitted_messages == 5
    # ...but after a link notice it is (what was in flight may really be lost).
    s.transport.deliver(relay_pb2.EdgeMessage(notice=relay_pb2.LinkNotice(up=False, reason="cut")))
    s.transport.deliver(relay_pb2.EdgeMessage(notice=relay_pb2.LinkNotice(up=True)))
    s.transport.deliver(ack(big - 1, PLENTY, resume=True))
    assert len(s.transport.take("frame")) == 5


class _SimEnd:
    """One end of ``_SlowWire``: a transport whose sends go on the fake-clock wire."""

    def __init__(self, wire: _SlowWire, index: int) -> None:
        self.wire, self.index = wire, index
        self.handler: TransportHandler | None = None

    def start(self, handler: TransportHandler) -> None:
        self.handler = handler
        handler.on_ready(relay_pb2.EdgeReady(max_window_bytes=self.wire.window, link_up=True))

    def send(self, message: relay_pb2.EdgeMessage) -> None:
        self.wire.push(self.index, message)

    def close(self, reason: str, error: bool) -> None:
        pass

    def wait_close_sent(self, timeout: float) -> None:
        pass

    def shutdown(self) -> None:
        pass


class _SlowWire:
    """Both directions at a fixed byte rate plus a one-way latency, in fake-clock time."""

    def __init__(self, clock: FakeClock, rate: float, latency: float, window: int) -> None:
        self.clock, self.rate, self.latency, self.window = clock, rate, latency, window
        self._lock = threading.Lock()
        self._queues: list[list[tuple[float, relay_pb2.EdgeMessage]]] = [[], []]
        self._free_at = [0.0, 0.0]
        self.ends = [_SimEnd(self, 0), _SimEnd(self, 1)]

    def push(self, index: int, message: relay_pb2.EdgeMessage) -> None:
        with self._lock:
            start = max(self.clock(), self._free_at[index])
            self._free_at[index] = start + message.ByteSize() / self.rate
            self._queues[index].append((self._free_at[index] + self.latency, message))

    def deliver_due(self) -> None:
        for index in (0, 1):
            while True:
                with self._lock:
                    queue = self._queues[index]
                    if not queue or queue[0][0] > self.clock():
                        break
                    _, message = queue.pop(0)
                handler = self.ends[1 - index].handler
                assert handler is not None
                handler.on_message(message)


def test_a_large_frame_on_a_slow_link_is_never_rewound_spuriously_and_arrives() -> None:
    clock = FakeClock()
    rate = float(1 << 20)  # 1 MiB/s
    wire = _SlowWire(clock, rate=rate, latency=0.05, window=32 << 20)
    settings = EdgeSettings(
        window_bytes=32 << 20, retransmit_s=120.0, min_retransmit_s=1.0, max_outage_s=300, ready_timeout_s=5
    )
    sender = EdgeSession(wire.ends[0], FORWARD, settings, name="up", clock=clock)
    receiver = EdgeSession(wire.ends[1], BACKWARD, settings, name="down", clock=clock)
    sender.start()
    receiver.start()
    rtos: list[float] = []

    def run_until(done: Callable[[], bool], limit: float, what: str) -> None:
        deadline = clock() + limit
        while not done():
            assert clock() < deadline, f"{what} not done in {limit} s of simulated time"
            clock.advance(0.01)
            wire.deliver_due()
            sender.poll_timers()
            rtos.append(sender.retransmit_timeout())

    start = clock()
    run_until(lambda: clock() > start + 0.5, 1, "the start-up resume acks")  # they replay what is sent
    for _ in range(3):  # warm-up: RTT samples and a throughput measure
        sender.enqueue_signal(relay_pb2.SIGNAL_KIND_SYNC, 0)
        sender.enqueue_tensor(tensor_builder(64 * 1024))
    run_until(lambda: not sender._buffer, 30, "warm-up")
    srtt, _, throughput = sender.rtt_estimate()
    assert srtt is not None and throughput is not None and throughput < rate * 1.05
    idle_rto = sender.retransmit_timeout()
    big = tensor_builder(6 * (1 << 20) // 4)  # 6 MiB in 24 chunks: ~6 s on the wire
    assert idle_rto < 3.0  # a timeout from the round trip alone would rewind it (twice)
    rtos.clear()
    sent = sender.enqueue_tensor(big)
    received: list[object] = []
    for _ in range(6):
        received.append(receiver.receive_item(5, "warm-up item"))
    run_until(lambda: not sender._buffer, 60, "the large frame")
    item = receiver.receive_item(5, "the large frame")
    assert isinstance(item, EncodedTensor) and item.payload == sent.payload
    print(
        f"slow link: srtt {srtt:.3f} s, throughput {throughput / rate:.2f} of the rate, idle rto "
        f"{idle_rto:.2f} s, rto while the frame was in flight {min(rtos):.2f}..{max(rtos):.2f} s, "
        f"frame took {len(rtos) / 100:.2f} s"
    )
    assert sender.retransmitted_messages == 0, f"spurious rewinds (rto samples {min(rtos)}..{max(rtos)})"
    assert max(rtos) < settings.retransmit_s  # the measured term, not the cap, kept it from rewinding
    sender.fail("test over", tell_peer=False)
    receiver.fail("test over", tell_peer=False)
