"""The delivery contract of relay.proto, rule by rule, on an ``EdgeSession`` with a scripted transport."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from nebula_common.codec import TensorStreamEncoder, to_frames
from nebula_common.jobspec.runtime import ProgramError
from nebula_common.proto.nebula.v1 import relay_pb2, tensor_pb2
from nebula_common.rpc.framing import FramedChunk, encode_chunk, parse_chunk
from services.trainer.edge import INITIAL_WINDOW_BYTES, EdgeClosedError, EdgeConnection, EdgeSettings
from services.trainer.edge.session import EdgeSession, TransportHandler, wire_size
from tests.support.edges import wait_for

pytestmark = pytest.mark.timeout(60)
FORWARD, BACKWARD = tensor_pb2.DIRECTION_FORWARD, tensor_pb2.DIRECTION_BACKWARD
SETTINGS = EdgeSettings(window_bytes=1 << 20, retransmit_s=30.0, max_outage_s=30.0, ready_timeout_s=5)


class ScriptedTransport:
    """Records what the session sends; the test plays the switch and the peer."""

    def __init__(self, max_window_bytes: int = 1 << 20) -> None:
        self.sent: list[relay_pb2.EdgeMessage] = []
        self.handler: TransportHandler | None = None
        self.max_window_bytes = max_window_bytes
        self.closes: list[tuple[str, bool]] = []

    def start(self, handler: TransportHandler) -> None:
        self.handler = handler
        handler.on_ready(relay_pb2.EdgeReady(max_window_bytes=self.max_window_bytes, link_up=True))

    def send(self, message: relay_pb2.EdgeMessage) -> None:
        self.sent.append(message)

    def close(self, reason: str, error: bool) -> None:
        self.closes.append((reason, error))

    def wait_close_sent(self, timeout: float) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def take(self, kind: str | None = None) -> list[relay_pb2.EdgeMessage]:
        taken = [m for m in self.sent if kind is None or m.WhichOneof("body") == kind]
        self.sent.clear()
        return taken

    def deliver(self, *messages: relay_pb2.EdgeMessage) -> None:
        assert self.handler is not None
        for message in messages:
            self.handler.on_message(message)


def ack(received: int, max_bytes: int, resume: bool = False) -> relay_pb2.EdgeMessage:
    return relay_pb2.EdgeMessage(
        ack=relay_pb2.EdgeAck(direction=FORWARD, received=received, max_bytes=max_bytes, resume=resume)
    )


def frames(tensor: torch.Tensor, frame_id: int, step: int = 0, chunk: int = 256 * 1024) -> list:
    encoded = TensorStreamEncoder("none").encode(tensor, step=step, direction=FORWARD, frame_id=frame_id)
    return [relay_pb2.EdgeMessage(frame=f) for f in to_frames(encoded, chunk)]


def signal(seq: int, step: int = 0) -> relay_pb2.EdgeMessage:
    return relay_pb2.EdgeMessage(
        signal=relay_pb2.EdgeSignal(seq=seq, direction=FORWARD, kind=relay_pb2.SIGNAL_KIND_SYNC, step=step)
    )


def sender() -> tuple[EdgeConnection, ScriptedTransport]:
    transport = ScriptedTransport()
    edge = EdgeConnection(transport, job_id="j", edge="e", upstream=True, settings=SETTINGS)
    return edge, transport


def receiver(settings: EdgeSettings = SETTINGS) -> tuple[EdgeSession, ScriptedTransport]:
    transport = ScriptedTransport()
    session = EdgeSession(transport, BACKWARD, settings)
    session.start()
    return session, transport


def test_frames_and_signals_share_one_sequence_and_the_first_ready_sends_a_resume_ack() -> None:
    edge, transport = sender()
    (first,) = transport.take("ack")
    assert first.ack.resume and first.ack.received == 0 and first.ack.direction == BACKWARD
    edge.send_tensor(torch.ones(2), 0, 0)
    edge.send_signal(relay_pb2.SIGNAL_KIND_READY, 0)
    edge.send_tensor(torch.ones(2), 0, 1)
    sent = transport.take()
    ids = [m.frame.header.frame_id for m in sent if m.HasField("frame") and m.frame.HasField("header")]
    assert ids == [1, 3]
    assert [m.signal.seq for m in sent if m.HasField("signal")] == [2]


def test_a_sender_stays_within_the_initial_window_and_then_the_absolute_credit() -> None:
    edge, transport = sender()
    transport.take()
    big = torch.zeros(3 * 256 * 1024 // 4)  # 768 KiB: one header and three chunks
    done = threading.Event()
    threading.Thread(
        target=lambda: (edge.send_tensor(big, 0, 0), edge.send_tensor(big, 0, 1), done.set())
    ).start()
    wait_for(lambda: done.is_set(), 10, "both tensors queued")
    sent = transport.take()
    assert sum(wire_size(m) for m in sent) <= INITIAL_WINDOW_BYTES
    assert len(sent) == 5  # frame 1 (4 messages) and frame 2's header; its first chunk would pass 1 MiB
    transport.deliver(ack(1, 2 * INITIAL_WINDOW_BYTES))
    rest = transport.take()
    assert [m.frame.chunk.offset for m in rest] == [0, 256 * 1024, 512 * 1024]
    assert edge.session._buffer and edge.session._buffer[0].seq == 2  # frame 1 acknowledged: dropped


def test_a_resume_ack_replays_everything_after_received_in_order() -> None:
    edge, transport = sender()
    transport.take()
    for micro_batch in range(3):
        edge.send_tensor(torch.full((4,), float(micro_batch)), 0, micro_batch)
    original = transport.take()
    assert len(original) == 6
    transport.deliver(ack(1, INITIAL_WINDOW_BYTES * 2, resume=True))
    assert transport.take() == original[2:]  # frames 2 and 3, header first, same bytes


def test_stateful_codec_bytes_are_encoded_once_and_replayed_identically() -> None:
    transport = ScriptedTransport()
    edge = EdgeConnection(
        transport, job_id="j", edge="e", upstream=True, codec_forward="ef(topk(0.1))", settings=SETTINGS
    )
    transport.take()
    torch.manual_seed(0)
    for step in range(3):
        edge.send_tensor(torch.randn(16, 16), step, 0)
    original = transport.take()
    edge.session.on_down("switch restarted")
    edge.session.on_ready(relay_pb2.EdgeReady(max_window_bytes=1 << 20, link_up=True))
    assert transport.take("ack")[0].ack.resume
    transport.deliver(ack(0, INITIAL_WINDOW_BYTES, resume=True))
    assert transport.take() == original
    assert edge._encoder.stats.tensors == 3  # the replay did not touch the error-feedback state


def test_a_receiver_ignores_duplicates_gaps_and_stray_chunks_and_restarts_a_replayed_header() -> None:
    session, transport = receiver()
    transport.take()
    one = frames(torch.ones(3), 1)
    two = frames(torch.full((3,), 2.0), 2)
    transport.deliver(*one, *one)  # a duplicate of frame 1: ignored, re-acknowledged
    acks = transport.take("ack")
    assert [a.ack.received for a in acks] == [1, 1]
    transport.deliver(signal(3))  # after a gap: ignored, and a replay is asked for
    (asked,) = transport.take("ack")
    assert asked.ack.resume and asked.ack.received == 1
    transport.deliver(two[0], two[1])  # header, then its only chunk
    transport.deliver(two[1])  # a stray chunk: ignored
    transport.deliver(signal(3))
    items = [session.receive_item(1, "item") for _ in range(3)]
    assert [type(i).__name__ for i in items] == ["EncodedTensor", "EncodedTensor", "EdgeSignal"]

    long = frames(torch.arange(100, dtype=torch.float32), 4, chunk=100)
    transport.deliver(long[0], long[1], long[2])  # header and two of four chunks ...
    transport.deliver(*long)  # ... then the replay from the header restarts the frame
    item = session.receive_item(1, "item")
    assert torch.equal(torch.frombuffer(bytearray(item.payload), dtype=torch.float32), torch.arange(100.0))
    assert session.max_over_grant_bytes <= 0


def placed(session: EdgeSession, message: relay_pb2.EdgeMessage) -> FramedChunk | None:
    """A chunk as the plain-records reader hands it on: its payload read straight into the frame."""
    chunk = message.frame.chunk
    raw, _ = encode_chunk("j", "e", 0, chunk.frame_id, chunk.offset, chunk.data, chunk.last)
    framed = parse_chunk(raw)
    where = session.place_chunk(framed, len(chunk.data))
    if where is None:
        return None
    token, target = where
    target[:] = chunk.data
    return dataclasses.replace(framed, data=target, placed=token)


def test_a_receiver_places_only_the_next_chunk_and_ignores_one_whose_frame_restarted() -> None:
    session, transport = receiver()
    transport.take()
    long = frames(torch.arange(100, dtype=torch.float32), 1, chunk=100)
    assert placed(session, long[1]) is None  # no frame yet
    transport.deliver(long[0])
    assert placed(session, long[2]) is None  # not the next chunk
    stale = placed(session, long[1])
    transport.deliver(long[0])  # the header again (a replay): the frame restarts in a new buffer
    assert stale is not None
    transport.deliver(stale)  # read into the old buffer: a stray now, ignored
    for message in long[1:]:
        chunk = placed(session, message)
        assert chunk is not None
        transport.deliver(chunk)
    item = session.receive_item(1, "item")
    assert torch.equal(torch.frombuffer(bytearray(item.payload), dtype=torch.float32), torch.arange(100.0))
    assert session.max_over_grant_bytes <= 0


def test_a_receiver_with_a_full_queue_grants_nothing_more_until_the_stage_reads() -> None:
    session, transport = receiver(
        EdgeSettings(window_bytes=1 << 20, retransmit_s=30, receive_queue_items=2, ready_timeout_s=5)
    )
    transport.take()
    for seq in (1, 2):
        transport.deliver(signal(seq))
    granted = transport.take("ack")[-1].ack.max_bytes
    transport.deliver(signal(3))
    assert transport.take("ack")[-1].ack.max_bytes == granted  # acknowledged, but no new credit
    session.receive_item(1, "item")
    assert transport.take("ack") == []  # still two waiting: still full
    session.receive_item(1, "item")
    assert transport.take("ack")[-1].ack.max_bytes > granted  # reading frees the queue: credit again


def test_a_receive_timeout_does_not_count_an_outage() -> None:
    session, transport = receiver()
    transport.take()
    session.on_down("switch restarted")
    result: list[object] = []
    waiter = threading.Thread(target=lambda: result.append(session.receive_item(0.3, "item")))
    waiter.start()
    wait_for(lambda: session.outage_seconds() > 0.6, 10, "an outage longer than the receive timeout")
    session.on_ready(relay_pb2.EdgeReady(max_window_bytes=1 << 20, link_up=True))
    transport.deliver(signal(1))
    waiter.join(5)
    assert len(result) == 1
    with pytest.raises(EdgeClosedError, match=r"no item in 0s"):
        session.receive_item(0.2, "item")


def test_a_header_above_max_frame_bytes_fails_the_edge_and_tells_the_peer() -> None:
    session, transport = receiver(EdgeSettings(max_frame_bytes=1000, ready_timeout_s=5))
    transport.deliver(frames(torch.zeros(1000), 1)[0])
    with pytest.raises(EdgeClosedError, match=r"announced a tensor of 4000 bytes .* max_frame_bytes 1000"):
        session.receive_item(1, "item")
    assert transport.closes and transport.closes[0][1] is True


def test_a_one_way_stage_refuses_a_produce_dtype_its_edge_payload_does_not_declare() -> None:
    from nebula_common.jobspec import load_spec
    from nebula_common.jobspec.builtin import builtin_spec
    from nebula_common.sdk.jobs import ProgramJob
    from services.trainer.runtime.one_way_steps import checked_payload

    cfg = ProgramJob(load_spec(builtin_spec("electra")), "j").stage_spec("generator").program
    assert torch.equal(checked_payload(cfg, torch.tensor([2**40])), torch.tensor([2**40]))
    with pytest.raises(
        ProgramError, match=r"the edge payload is int64 but produce\(\) returned torch.float32"
    ):
        checked_payload(cfg, torch.zeros(3))


def test_a_reopened_stream_resends_what_is_unacknowledged_without_waiting_for_the_peer() -> None:
    """The peer's link stayed up, so no notice makes it ask for a replay: the sender resends itself."""
    edge, transport = sender()
    transport.take()
    edge.send_tensor(torch.ones(4), 0, 0)
    edge.send_tensor(torch.ones(4), 0, 1)
    original = transport.take()
    transport.deliver(ack(1, INITIAL_WINDOW_BYTES))  # the peer holds frame 1
    edge.session.on_down("stream to the switch reset")
    edge.session.on_ready(relay_pb2.EdgeReady(max_window_bytes=1 << 20, link_up=True))
    resent = transport.take()
    assert [m for m in resent if m.HasField("frame")] == original[2:]  # frame 2 only
    assert [m.ack.resume for m in resent if m.HasField("ack")] == [True]
