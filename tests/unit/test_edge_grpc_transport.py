"""The gRPC edge transport against a scripted Relay server: reconnects after a failed stream,
gives up on refusals and on a switch whose messages do not parse."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from nebula_common.proto.nebula.v1 import relay_pb2, relay_pb2_grpc, tensor_pb2
from nebula_common.rpc.framing import LINK_FRAMING_VERSION
from services.trainer.edge import EdgeClosedError, EdgeSession, EdgeSettings, GrpcEdgeTransport
from services.trainer.edge.session import TransportHandler
from tests.support.edges import wait_for
from tests.support.hostile_switch import CORRUPT_CHUNK, NOT_AN_EDGE_MESSAGE, hostile_relay, started_threads

pytestmark = pytest.mark.timeout(60)


class ScriptedRelay(relay_pb2_grpc.RelayServicer):
    """Each OpenEdge call takes the next entry of ``script``: a status code to abort with after
    ready ("drop"), a code to refuse the open with, "stay" to keep the stream open, or "unframed" to
    answer with a ready announcing no link framing."""

    def __init__(self, script: list[tuple[str, grpc.StatusCode | None]]) -> None:
        self.script = script
        self.opens: list[relay_pb2.EdgeOpen] = []
        self.received: list[relay_pb2.EdgeMessage] = []
        self.lock = threading.Lock()

    def OpenEdge(
        self, request_iterator: Iterator[relay_pb2.EdgeMessage], context: grpc.ServicerContext
    ) -> Iterator[relay_pb2.EdgeMessage]:
        first = next(request_iterator)
        with self.lock:
            self.opens.append(first.open)
            action, code = self.script.pop(0) if self.script else ("stay", None)
        if action == "refuse":
            context.abort(code, "token expired")
        framing = 0 if action == "unframed" else LINK_FRAMING_VERSION
        ready = relay_pb2.EdgeReady(max_window_bytes=1 << 20, link_up=True, link_framing=framing)
        yield relay_pb2.EdgeMessage(ready=ready)
        if action == "drop":
            next(request_iterator)  # the session's resume ack
            context.abort(code, "switch restarting")
        for message in request_iterator:
            with self.lock:
                self.received.append(message)
            if message.HasField("signal"):  # the peer holds it
                ack = relay_pb2.EdgeAck(received=message.signal.seq, max_bytes=1 << 30)
                yield relay_pb2.EdgeMessage(ack=ack)
            if message.HasField("close"):
                yield relay_pb2.EdgeMessage(close=relay_pb2.EdgeClose(reason="peer done"))
                return


@pytest.fixture
def relay() -> Iterator[tuple[ScriptedRelay, str]]:
    servicer = ScriptedRelay([])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    relay_pb2_grpc.add_RelayServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


class Events:
    def __init__(self) -> None:
        self.log: list[str] = []

    def on_ready(self, ready: relay_pb2.EdgeReady) -> None:
        self.log.append("ready")

    def on_message(self, message: relay_pb2.EdgeMessage) -> None:
        self.log.append(message.WhichOneof("body") or "")

    def on_down(self, reason: str) -> None:
        self.log.append(f"down: {reason}")

    def on_failed(self, reason: str) -> None:
        self.log.append(f"failed: {reason}")


def test_a_failed_stream_is_reopened_with_reconnect_and_the_session_resumes(
    relay: tuple[ScriptedRelay, str],
) -> None:
    servicer, address = relay
    servicer.script = [("drop", grpc.StatusCode.UNAVAILABLE), ("drop", grpc.StatusCode.INTERNAL)]
    transport = GrpcEdgeTransport(address, "token", "job", "e", backoff_initial_s=0.05, backoff_max_s=0.2)
    session = EdgeSession(transport, tensor_pb2.DIRECTION_FORWARD, EdgeSettings(), name="e")
    session.start()
    wait_for(lambda: len(servicer.opens) >= 3 and session.link_up, 20, "the third open and a live session")
    assert [o.reconnect for o in servicer.opens] == [False, True, True]
    assert session.outage_seconds() > 0
    session.enqueue_signal(relay_pb2.SIGNAL_KIND_READY, 0)
    wait_for(lambda: any(m.HasField("signal") for m in servicer.received), 10, "the signal on the new stream")
    acks = [m.ack for m in servicer.received if m.HasField("ack")]
    assert acks and acks[0].resume  # the reopened stream starts with a resume ack
    session.close("finished", timeout=10)
    assert any(m.HasField("close") for m in servicer.received)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED])
def test_a_refusal_fails_at_once_with_the_switch_message(
    relay: tuple[ScriptedRelay, str], code: grpc.StatusCode
) -> None:
    servicer, address = relay
    servicer.script = [("refuse", code)]
    events = Events()
    transport = GrpcEdgeTransport(address, "token", "job", "e", backoff_initial_s=0.05)
    handler: TransportHandler = events
    transport.start(handler)
    wait_for(lambda: any(e.startswith("failed") for e in events.log), 10, "the refusal")
    assert events.log == [f"failed: switch refused edge 'e': {code.name}: token expired"]
    assert len(servicer.opens) == 1  # no retry
    transport.shutdown()


def test_a_ready_without_link_framing_fails_at_once_naming_the_field(
    relay: tuple[ScriptedRelay, str],
) -> None:
    servicer, address = relay
    servicer.script = [("unframed", None)]
    events = Events()
    transport = GrpcEdgeTransport(address, "token", "job", "e", backoff_initial_s=0.05)
    handler: TransportHandler = events
    transport.start(handler)
    wait_for(lambda: any(e.startswith("failed") for e in events.log), 10, "the refusal")
    assert events.log == [
        "failed: refused the switch's ready for edge 'e': EdgeReady.link_framing 0 is not supported: "
        "it must be 1 (framed payload chunks)"
    ]
    assert [o.link_framing for o in servicer.opens] == [
        LINK_FRAMING_VERSION
    ]  # the open announced it; no retry
    transport.shutdown()


def test_an_unreachable_switch_fails_the_first_open_after_ready_timeout_with_the_last_error() -> None:
    transport = GrpcEdgeTransport(
        "127.0.0.1:1", "token", "job", "e", backoff_initial_s=0.05, backoff_max_s=0.1
    )
    session = EdgeSession(
        transport, tensor_pb2.DIRECTION_FORWARD, EdgeSettings(ready_timeout_s=1.0), name="e"
    )
    with pytest.raises(EdgeClosedError, match=r"did not open edge 'e' within 1s \(last error: .*UNAVAILABLE"):
        session.start()


@pytest.mark.parametrize(
    ("garbage", "problem"),
    [
        pytest.param(
            NOT_AN_EDGE_MESSAGE,
            "a message that is not an EdgeMessage: Error parsing message with type 'nebula.v1.EdgeMessage'",
            id="not-an-edge-message",
        ),
        pytest.param(
            CORRUPT_CHUNK,
            "a framed chunk that does not parse: framed chunk has field number 0, which protobuf "
            "does not allow",
            id="corrupt-framed-chunk",
        ),
    ],
)
def test_a_message_from_the_switch_that_does_not_parse_fails_the_edge_at_once_naming_it(
    garbage: bytes, problem: str
) -> None:
    with hostile_relay(garbage) as (relay, address):
        before = set(threading.enumerate())
        events = Events()
        transport = GrpcEdgeTransport(address, "token", "job", "e", backoff_initial_s=0.05)
        handler: TransportHandler = events
        transport.start(handler)
        wait_for(lambda: any(e.startswith("failed") for e in events.log), 10, "the edge's failure")
        assert events.log[0] == "ready"
        assert events.log[1].startswith(f"failed: the switch sent edge 'e' {problem}"), events.log
        wait_for(lambda: relay.ended == 1, 10, "the trainer's end to cancel the stream")
        # Nothing of the transport is left running, though nobody shut it down.
        wait_for(lambda: not started_threads(before), 10, "the transport's threads to end")
        assert len(events.log) == 2 and len(relay.opens) == 1  # failed once, no reconnect
        transport.shutdown()


def test_a_switch_that_sends_garbage_instead_of_its_ready_fails_the_session_start_naming_it() -> None:
    with hostile_relay(CORRUPT_CHUNK, ready=False) as (relay, address):
        transport = GrpcEdgeTransport(address, "token", "job", "e", backoff_initial_s=0.05)
        session = EdgeSession(transport, tensor_pb2.DIRECTION_FORWARD, EdgeSettings(), name="e")
        with pytest.raises(
            EdgeClosedError,
            match=r"^the switch sent edge 'e' a framed chunk that does not parse: framed chunk has field "
            r"number 0",
        ):
            session.start()
        assert len(relay.opens) == 1  # no reconnect
        wait_for(lambda: relay.ended == 1, 10, "the trainer's end to cancel the stream")
