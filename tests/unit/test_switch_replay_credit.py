"""A sender's rewind while its originals still wait in switch a: the credit bound must hold.

Seen in the relay benchmark at load ~40: switch a closed a 16 MiB route for its credit bound
(17,826,118 bytes waiting for the link > 2 x 8 MiB + 64 KiB). The sender's retransmit timeout
rewinds and resends its whole unacknowledged window while the originals are still queued in switch
a toward the link; a second rewind before the first drained queued a third window.

Real parts: two ``EdgeSession``s (sender and receiver, on fake clocks so the retransmit timer fires
when the test says) and the two switches' real ``Router``s. The test plays what carries bytes between
them: each trainer's stream (a list the test hands to ``accept_local`` / takes from ``pop_inbound``,
serialized and parsed as on the wire) and the link (``next_outbound`` of one router, serialized,
parsed and handed to ``deliver`` of the other, as the link reader does). Holding switch a's link
writer is simply not moving its items.
"""

from __future__ import annotations

import collections

import pytest
import torch
from prometheus_client import REGISTRY

from nebula_common.codec import TensorStreamEncoder
from nebula_common.codec.wire import decode_tensor
from nebula_common.proto.nebula.v1 import link_pb2, relay_pb2, tensor_pb2
from nebula_common.rpc.framing import FramedChunk, is_framed, parse_chunk
from services.switch.route_limits import SLACK_BYTES, Limits
from services.switch.routing import Router
from services.trainer.edge import EdgeSettings
from services.trainer.edge.session import EdgeSession, EdgeTimeout, TransportHandler
from tests.support.clock import FakeClock

pytestmark = pytest.mark.timeout(60)
FORWARD, BACKWARD = tensor_pb2.DIRECTION_FORWARD, tensor_pb2.DIRECTION_BACKWARD
KEY = ("job-replay", "up->down")
WINDOW = 1 << 20
SETTINGS = EdgeSettings(
    window_bytes=WINDOW, retransmit_s=1.0, min_retransmit_s=0.5, max_outage_s=3600.0, ready_timeout_s=5
)
VALUES = 200_000  # 800 KB of float32: one tensor is most of a window (a header and four chunks)


class StreamEnd:
    """A trainer's stream to its switch: what the session sends waits here until the test moves it."""

    frames_chunks = True  # as the gRPC transport: payload chunks are framed bytes

    def __init__(self) -> None:
        self.sent: collections.deque[relay_pb2.EdgeMessage | bytes] = collections.deque()
        self.handler: TransportHandler | None = None

    def start(self, handler: TransportHandler) -> None:
        self.handler = handler
        handler.on_ready(relay_pb2.EdgeReady(max_window_bytes=WINDOW, link_up=True, link_framing=1))

    def send(self, message: relay_pb2.EdgeMessage | bytes) -> None:
        self.sent.append(message)

    def close(self, reason: str, error: bool) -> None:
        pass

    def wait_close_sent(self, timeout: float) -> None:
        pass

    def shutdown(self) -> None:
        pass


class Path:
    """Sender -> switch a -> link -> switch b -> receiver, and the acks back."""

    def __init__(self) -> None:
        limits = Limits(max_window_bytes=WINDOW)
        self.closes: list[dict] = []
        record = lambda event, **fields: self.closes.append({"event": event, **fields})  # noqa: E731
        self.a = Router(limits, cluster_id="a", record=record)
        self.b = Router(limits, cluster_id="b", record=record)
        self.a.peer_cluster_id, self.b.peer_cluster_id = "b", "a"
        self.a.link_up = self.b.link_up = True
        self.route_a, self.att_a = self.a.attach(KEY, "alice")
        self.route_b, self.att_b = self.b.attach(KEY, "alice")
        self.clock = FakeClock()
        self.up = StreamEnd()
        self.down = StreamEnd()
        self.sender = EdgeSession(self.up, FORWARD, SETTINGS, name="up", clock=self.clock, route=KEY)
        self.receiver = EdgeSession(self.down, BACKWARD, SETTINGS, name="down", clock=FakeClock(), route=KEY)
        self.sender.start()
        self.receiver.start()

    # --- the trainers' streams (the relay servicer's reader and writer)
    def _upstream(self, end: StreamEnd, router: Router, route, attachment) -> None:  # noqa: ANN001
        while end.sent:
            message = end.sent.popleft()
            if isinstance(message, bytes):
                assert is_framed(message)
                item: relay_pb2.EdgeMessage | FramedChunk = parse_chunk(message)
            else:
                item = relay_pb2.EdgeMessage.FromString(message.SerializeToString())
            router.accept_local(route, attachment, item)

    def _downstream(self, session: EdgeSession, router: Router, route, attachment) -> None:  # noqa: ANN001
        while (item := router.pop_inbound(route, attachment)) is not None:
            if isinstance(item, FramedChunk):
                session.on_message(parse_chunk(bytes(item.raw)))
            else:
                session.on_message(relay_pb2.EdgeMessage.FromString(item.SerializeToString()))

    def streams(self, to_receiver: bool = True) -> None:
        """Move everything the trainers sent into their switches, and everything buffered to them
        (without ``to_receiver``, switch b's stream to the receiver does not move: a slow reader)."""
        for _ in range(4):
            self._upstream(self.up, self.a, self.route_a, self.att_a)
            self._upstream(self.down, self.b, self.route_b, self.att_b)
            self._downstream(self.sender, self.a, self.route_a, self.att_a)
            if to_receiver:
                self._downstream(self.receiver, self.b, self.route_b, self.att_b)

    # --- the link (the link writer of one switch, the reader of the other)
    @staticmethod
    def _carry(source: Router, target: Router, limit: int | None) -> int:
        moved = 0
        while limit is None or moved < limit:
            out = source.next_outbound()
            if out is None:
                break
            if isinstance(out, FramedChunk):
                chunk = parse_chunk(bytes(out.raw))
                target.deliver((chunk.job_id, chunk.edge), chunk, chunk.epoch)
            else:
                routed = link_pb2.LinkMessage.FromString(out.SerializeToString()).routed
                target.deliver((routed.job_id, routed.edge), routed.item, routed.epoch)
            moved += 1
        return moved

    def link_a_to_b(self, limit: int | None = None) -> int:
        return self._carry(self.a, self.b, limit)

    def link_b_to_a(self) -> int:
        return self._carry(self.b, self.a, None)

    def settle(self) -> None:
        """Run streams and both link directions until nothing moves."""
        for _ in range(200):
            self.streams()
            moved = self.link_a_to_b() + self.link_b_to_a()
            self.streams()
            if not moved and not self.up.sent and not self.down.sent:
                return
        raise AssertionError("the path did not settle in 200 rounds")

    def rewind_by_timeout(self) -> None:
        """Let the sender's retransmit timeout (with its backoff) expire: it rewinds once."""
        before = self.sender.retransmitted_messages
        self.clock.advance(self.sender.retransmit_timeout() + 0.01)
        self.sender.poll_timers()
        assert self.sender.retransmitted_messages > before, "the retransmit timer did not rewind"

    def received(self) -> list[torch.Tensor]:
        got = []
        while True:
            try:
                item = self.receiver.receive_item(0, "tensor")
            except EdgeTimeout:
                return got
            assert not isinstance(item, relay_pb2.EdgeSignal)
            got.append(decode_tensor(item.header, item.payload))

    def send(self, first: float) -> torch.Tensor:
        tensor = torch.arange(VALUES, dtype=torch.float32) + first
        self.sender.enqueue_tensor(
            lambda frame_id: TensorStreamEncoder("none").encode(
                tensor, step=0, direction=FORWARD, frame_id=frame_id
            )
        )
        return tensor

    def shutdown(self) -> None:
        for session in (self.sender, self.receiver):
            session.fail("test over", tell_peer=False)


def superseded_items(direction: str) -> float:
    value = REGISTRY.get_sample_value("nebula_switch_items_superseded_total", {"direction": direction})
    return 0.0 if value is None else value


@pytest.fixture
def path():  # noqa: ANN201
    p = Path()
    try:
        p.settle()  # readies and resume acks both ways: the sender has the receiver's credit
        yield p
    finally:
        p.shutdown()


def test_rewinds_while_originals_wait_at_switch_a_keep_the_route_open(path: Path) -> None:
    sent = path.send(0.0)
    path.streams()
    queued = path.route_a.outbound_bytes
    assert queued > WINDOW // 2, "the sender's originals should wait in switch a (its link writer is held)"
    superseded = superseded_items("to_peer")

    # Switch a's link writer is held: no ack can come back, so the sender rewinds, twice.
    for _ in range(2):
        path.rewind_by_timeout()
        path.streams()
        assert path.route_a.closed_reason is None, path.route_a.closed_reason
        # The replay replaced the queued originals it resends: one window, not one per rewind.
        assert path.route_a.outbound_bytes <= WINDOW + SLACK_BYTES
    assert not [c for c in path.closes if c["event"] == "route.closed"], path.closes
    # Each rewind replaced the header and the four chunks still queued.
    assert superseded_items("to_peer") - superseded >= 2 * 5

    path.settle()
    got = path.received()
    assert len(got) == 1 and torch.equal(got[0], sent), "the tensor must arrive exactly once"
    assert path.sender._in_flight_bytes_locked() == 0, "everything sent must be acknowledged"


def test_rewind_after_part_of_the_window_crossed_delivers_in_order_exactly_once(path: Path) -> None:
    first = path.send(0.0)
    path.settle()
    assert [t.equal(first) for t in path.received()] == [True]

    second = path.send(1.0)
    path.streams()
    # Part of the second tensor crosses (its header and a chunk), the rest waits in switch a.
    assert path.link_a_to_b(limit=2) == 2
    path.streams()
    path.rewind_by_timeout()  # the replay starts below what already crossed
    path.streams(to_receiver=False)
    assert path.route_a.outbound_bytes <= WINDOW + SLACK_BYTES
    # Meanwhile switch b's stream to the receiver is slow: the replay's copies queue behind the
    # originals there, and a second rewind must not pile up a third copy at switch b.
    path.link_a_to_b()
    path.rewind_by_timeout()
    path.streams(to_receiver=False)
    path.link_a_to_b()
    assert path.route_b.closed_reason is None, path.route_b.closed_reason
    assert path.route_b.inbound_bytes <= 2 * WINDOW + SLACK_BYTES
    path.settle()
    third = path.send(2.0)
    path.settle()
    got = path.received()
    assert len(got) == 2, f"expected the second and third tensors once each, got {len(got)} tensors"
    assert torch.equal(got[0], second) and torch.equal(got[1], third)
    assert path.route_a.closed_reason is None and path.route_b.closed_reason is None
