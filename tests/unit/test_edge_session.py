"""The delivery contract of relay.proto, rule by rule, on an ``EdgeSession`` with a scripted transport."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from nebula_common.codec import EncodedTensor, TensorStreamDecoder, TensorStreamEncoder, to_frames
from nebula_common.jobspec.runtime import ProgramError
from nebula_common.proto.nebula.v1 import relay_pb2, tensor_pb2
from nebula_common.rpc.framing import ChunkHead, encode_chunk, parse_chunk, parse_chunk_head
from nebula_common.rpc.raw_records import PREFIX_BYTES, PlacedMessage, Placement
from services.trainer.edge import INITIAL_WINDOW_BYTES, EdgeClosedError, EdgeConnection, EdgeSettings
from services.trainer.edge.raw_transport import placed_chunk
from services.trainer.edge.session import EdgeSession, TransportHandler, _Assembly, wire_size
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


def test_a_one_way_stage_refuses_a_produce_dtype_its_edge_payload_does_not_declare(tmp_path: Path) -> None:
    from nebula_common.jobspec import load_spec
    from nebula_common.jobspec.builtin import builtin_spec
    from nebula_common.sdk.jobs import ProgramJob
    from services.trainer.runtime.stage import ProgramRunner

    spec = ProgramJob(load_spec(builtin_spec("electra")), "j").stage_spec("generator")
    runner = ProgramRunner(spec, "t", "unused:0", tmp_path, "o")
    assert torch.equal(runner._check_payload(torch.tensor([2**40])), torch.tensor([2**40]))
    with pytest.raises(
        ProgramError, match=r"the edge payload is int64 but produce\(\) returned torch.float32"
    ):
        runner._check_payload(torch.zeros(3))


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


# ---------------------------------------------------------------- placed chunks (a raw edge's I/O thread)

PLACED_CHUNK = 4096
"""Chunk size of the placement tests: PLACED_NUMEL float32 make four full chunks and a short one."""
PLACED_NUMEL = 4121


@dataclass
class FramedTensor:
    """A tensor as the sending session frames it on a link-framing stream: a header and framed chunks."""

    tensor: torch.Tensor
    header: relay_pb2.EdgeMessage
    chunks: list[bytes]
    offsets: list[int]
    payload: bytes


def framed_tensor(frame_id: int, seed: int = 0, numel: int = PLACED_NUMEL) -> FramedTensor:
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    encoded = TensorStreamEncoder("none").encode(tensor, step=0, direction=FORWARD, frame_id=frame_id)
    header = relay_pb2.EdgeMessage(frame=tensor_pb2.TensorFrame(header=encoded.header))
    payload = memoryview(encoded.payload)
    chunks: list[bytes] = []
    offsets = list(range(0, len(payload), PLACED_CHUNK))
    for offset in offsets:
        end = min(offset + PLACED_CHUNK, len(payload))
        raw, _ = encode_chunk("j", "e", 0, frame_id, offset, payload[offset:end], end == len(payload))
        chunks.append(raw)
    return FramedTensor(tensor, header, chunks, offsets, bytes(payload))


def head_of(raw: bytes) -> ChunkHead:
    """What the I/O thread reads first: the head of a chunk from its first PREFIX_BYTES bytes."""
    head = parse_chunk_head(raw[:PREFIX_BYTES], len(raw))
    assert head is not None
    return head


def place(session: EdgeSession, raw: bytes) -> Placement | None:
    return session.place_chunk(head_of(raw))


def write_placed(placement: Placement, raw: bytes) -> None:
    """The I/O thread receiving the chunk's tail straight into ``dest`` (its first bytes, then the rest)."""
    assert len(placement.dest) == len(raw) - placement.start
    early = min(PREFIX_BYTES, len(raw)) - placement.start
    placement.dest[:early] = raw[placement.start : placement.start + early]
    placement.dest[early:] = raw[placement.start + early :]


def deliver_placed(session: EdgeSession, raw: bytes, placement: Placement) -> None:
    session.on_message(placed_chunk(PlacedMessage(raw[: placement.start], placement)))


def place_write_release_deliver(session: EdgeSession, raw: bytes) -> Placement:
    placement = place(session, raw)
    assert placement is not None
    write_placed(placement, raw)
    placement.release()
    deliver_placed(session, raw, placement)
    return placement


def deliver_whole(session: EdgeSession, raw: bytes) -> None:
    session.on_message(parse_chunk(raw))


def received_tensor(session: EdgeSession) -> tuple[EncodedTensor, torch.Tensor]:
    item = session.receive_item(5, "placed tensor")
    assert isinstance(item, EncodedTensor)
    return item, TensorStreamDecoder("none").decode(item.header, item.payload)


def assembly_of(placement: Placement) -> _Assembly:
    info = placement.info
    assert isinstance(info, tuple) and isinstance(info[1], _Assembly)
    return info[1]


def test_placed_chunks_land_in_the_frame_buffer_which_becomes_the_delivered_payload_without_a_copy() -> None:
    session, transport = receiver()
    transport.take()
    sent = framed_tensor(1)
    assert len(sent.chunks) == 5
    transport.deliver(sent.header)
    frame_buffer = session._assembly.payload if session._assembly is not None else None
    assert isinstance(frame_buffer, bytearray) and len(frame_buffer) == len(sent.payload)
    placements: list[Placement] = []
    for index, (raw, offset) in enumerate(zip(sent.chunks, sent.offsets, strict=True)):
        placement = place(session, raw)
        assert placement is not None, f"chunk {index} was not placed"
        head = head_of(raw)
        assert placement.start == head.data_start
        assert assembly_of(placement) is session._assembly
        assert placement.dest.obj is frame_buffer  # a view of the frame's own buffer ...
        assert len(placement.dest) == head.data_size
        write_placed(placement, raw)
        end = offset + head.data_size
        assert frame_buffer[offset:end] == sent.payload[offset:end]  # ... at this chunk's offset
        placement.release()
        deliver_placed(session, raw, placement)
        placements.append(placement)
        if index < len(sent.chunks) - 1:
            assert not session._queue  # the frame is complete only with its last chunk
    item, tensor = received_tensor(session)
    assert torch.equal(tensor, sent.tensor)
    assert bytes(item.payload) == sent.payload
    assert item.payload is frame_buffer  # no copy: the frame's buffer is the payload
    assert all(assembly_of(p).payload is item.payload for p in placements)
    assert assembly_of(placements[0]).writers == 0
    assert session.max_over_grant_bytes <= 0
    assert [a.ack.received for a in transport.take("ack")][-1] == 1


def test_the_next_chunk_may_be_placed_before_the_previous_one_is_handled() -> None:
    """The I/O thread reads on while the event loop has not yet handled the chunk it handed on."""
    session, transport = receiver()
    transport.take()
    sent = framed_tensor(1, seed=1)
    transport.deliver(sent.header)
    placements: list[Placement] = []
    for raw in sent.chunks:  # all placed and written before any is delivered
        placement = place(session, raw)
        assert placement is not None
        write_placed(placement, raw)
        placement.release()
        placements.append(placement)
    for raw, placement in zip(sent.chunks, placements, strict=True):
        deliver_placed(session, raw, placement)
    item, tensor = received_tensor(session)
    assert torch.equal(tensor, sent.tensor)
    assert item.payload is assembly_of(placements[0]).payload


def test_placement_is_refused_without_a_frame_being_assembled() -> None:
    session, transport = receiver()
    transport.take()
    sent = framed_tensor(1)
    assert place(session, sent.chunks[0]) is None  # no header yet
    transport.deliver(sent.header)
    for raw in sent.chunks:
        place_write_release_deliver(session, raw)
    received_tensor(session)
    assert place(session, sent.chunks[0]) is None  # the frame is complete: none assembled any more


def test_placement_is_refused_for_a_chunk_that_is_not_the_next_one_of_the_frame() -> None:
    session, transport = receiver()
    transport.take()
    sent = framed_tensor(1)
    transport.deliver(sent.header)
    assembly = session._assembly
    assert assembly is not None
    assert place(session, sent.chunks[1]) is None  # ahead
    assert place(session, sent.chunks[4]) is None  # the last one, far ahead
    place_write_release_deliver(session, sent.chunks[0])
    place_write_release_deliver(session, sent.chunks[1])
    assert place(session, sent.chunks[0]) is None  # behind
    assert place(session, sent.chunks[1]) is None  # the one just handled
    assert place(session, sent.chunks[3]) is None  # ahead
    assert (assembly.placed, assembly.writers) == (2 * PLACED_CHUNK, 0)  # refusals changed nothing
    for raw in sent.chunks[2:]:
        place_write_release_deliver(session, raw)
    _, tensor = received_tensor(session)
    assert torch.equal(tensor, sent.tensor)


def test_placement_is_refused_for_a_chunk_of_another_frame_or_past_the_declared_payload() -> None:
    session, transport = receiver()
    transport.take()
    sent = framed_tensor(1)
    transport.deliver(sent.header)
    size = len(sent.payload)
    other_frame, _ = encode_chunk("j", "e", 0, 2, 0, sent.payload[:PLACED_CHUNK], False)
    too_long, _ = encode_chunk("j", "e", 0, 1, 0, sent.payload + b"\x00", True)
    assert place(session, other_frame) is None
    assert place(session, too_long) is None
    for raw in sent.chunks[:4]:
        place_write_release_deliver(session, raw)
    last_offset = sent.offsets[4]
    overrun, _ = encode_chunk("j", "e", 0, 1, last_offset, sent.payload[last_offset:] + b"\x00" * 9, True)
    assert place(session, overrun) is None
    assert session._assembly is not None and session._assembly.placed == last_offset
    place_write_release_deliver(session, sent.chunks[4])
    _, tensor = received_tensor(session)
    assert torch.equal(tensor, sent.tensor)
    assert size == PLACED_NUMEL * 4


def test_placement_is_refused_once_the_session_failed() -> None:
    session, transport = receiver()
    transport.take()
    sent = framed_tensor(1)
    transport.deliver(sent.header)
    place_write_release_deliver(session, sent.chunks[0])
    session.on_failed("switch connection lost for good")
    assert place(session, sent.chunks[1]) is None
    assert session._assembly is not None and session._assembly.writers == 0


def test_chunks_received_whole_complete_the_frame_and_the_next_chunk_is_placed_again() -> None:
    session, transport = receiver()
    transport.take()
    first, second = framed_tensor(1, seed=2), framed_tensor(2, seed=3)
    transport.deliver(first.header)
    buffer = session._assembly.payload if session._assembly is not None else None
    placed_flags = [True, False, True, False, False]  # the last one whole
    for raw, placed in zip(first.chunks, placed_flags, strict=True):
        if placed:
            placement = place_write_release_deliver(session, raw)
            assert placement.dest.obj is buffer
        else:
            deliver_whole(session, raw)
    item, tensor = received_tensor(session)
    assert torch.equal(tensor, first.tensor)
    assert item.payload is buffer  # no placement outstanding: still no copy

    transport.deliver(second.header)
    deliver_whole(session, second.chunks[0])
    for raw in second.chunks[1:]:  # whole, then placed again up to the last one
        placement = place_write_release_deliver(session, raw)
    item, tensor = received_tensor(session)
    assert torch.equal(tensor, second.tensor)
    assert item.payload is assembly_of(placement).payload
    assert session.max_over_grant_bytes <= 0


@pytest.mark.parametrize("rest_placed", [False, True], ids=["rest-whole", "rest-placed"])
def test_a_frame_completed_while_a_placement_is_still_written_delivers_a_copy(rest_placed: bool) -> None:
    """Chunk 2's writer (a connection that died inside it) has not released it when chunk 2 arrives
    again (a replay) and the frame completes: the delivered payload must not be the buffer it writes."""
    session, transport = receiver()
    transport.take()
    sent = framed_tensor(1, seed=4)
    transport.deliver(sent.header)
    for raw in sent.chunks[:2]:
        place_write_release_deliver(session, raw)
    stale = place(session, sent.chunks[2])
    assert stale is not None
    buffer = assembly_of(stale).payload
    early = PREFIX_BYTES - stale.start
    stale.dest[:early] = sent.chunks[2][stale.start : PREFIX_BYTES]  # the writer got this far ...
    deliver_whole(session, sent.chunks[2])  # ... and the chunk arrives again, whole
    for raw in sent.chunks[3:]:
        if rest_placed:
            place_write_release_deliver(session, raw)
        else:
            deliver_whole(session, raw)
    item, tensor = received_tensor(session)
    assert item.payload is not buffer  # a copy ...
    assert bytes(item.payload) == sent.payload  # ... with the right bytes
    assert torch.equal(tensor, sent.tensor)
    stale.dest[:] = b"\xff" * len(stale.dest)  # the late writer goes on into the frame's buffer
    stale.release()
    assert bytes(item.payload) == sent.payload
    assert torch.equal(tensor, sent.tensor)
    assert torch.equal(TensorStreamDecoder("none").decode(item.header, item.payload), sent.tensor)


def test_a_placed_chunk_handled_after_a_replayed_header_restarted_the_frame_is_copied_from_its_buffer() -> (
    None
):
    session, transport = receiver()
    transport.take()
    sent = framed_tensor(1, seed=5)
    transport.deliver(sent.header)
    old = place(session, sent.chunks[0])  # placed into the first assembly of frame 1 ...
    assert old is not None
    write_placed(old, sent.chunks[0])
    old.release()
    old_assembly = assembly_of(old)
    transport.deliver(sent.header)  # ... which a replayed header replaces before the chunk is handled
    new_assembly = session._assembly
    assert new_assembly is not None and new_assembly is not old_assembly
    deliver_placed(session, sent.chunks[0], old)
    assert new_assembly.received == PLACED_CHUNK
    assert new_assembly.payload[:PLACED_CHUNK] == sent.payload[:PLACED_CHUNK]  # copied across
    for raw in sent.chunks[1:]:
        placement = place_write_release_deliver(session, raw)
        assert assembly_of(placement) is new_assembly
    item, tensor = received_tensor(session)
    assert torch.equal(tensor, sent.tensor)
    assert bytes(item.payload) == sent.payload
    assert item.payload is new_assembly.payload and item.payload is not old_assembly.payload


def test_a_placed_chunk_of_an_abandoned_assembly_still_being_written_cannot_touch_the_new_frame() -> None:
    session, transport = receiver()
    transport.take()
    sent = framed_tensor(1, seed=6)
    transport.deliver(sent.header)
    stale = place(session, sent.chunks[0])
    assert stale is not None
    transport.deliver(sent.header)  # a replay restarts the frame while the old writer is still busy
    for raw in sent.chunks:
        place_write_release_deliver(session, raw)
    item, tensor = received_tensor(session)
    stale.dest[:] = b"\xee" * len(stale.dest)
    stale.release()
    assert item.payload is not assembly_of(stale).payload
    assert bytes(item.payload) == sent.payload
    assert torch.equal(tensor, sent.tensor)
