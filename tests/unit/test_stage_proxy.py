"""The stage proxy between a stage process and its switch, fed bytes that do not parse: from a hostile
switch while it closes a dead stage's edges, and from a hostile stage on an open edge. Each fails that
edge only, named; the proxy goes on serving the others."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from pathlib import Path

import pytest

from nebula_common.proto.nebula.v1 import relay_pb2
from services.trainer.edge import EdgeConnection, EdgeSettings, GrpcEdgeTransport
from services.trainer.edge.session import TransportHandler
from services.trainer.stage_proxy import TELL_TIMEOUT_S, StageProxy
from tests.support.edges import SwitchPair, edge_end, open_pair
from tests.support.hostile_switch import CORRUPT_CHUNK, NOT_AN_EDGE_MESSAGE, hostile_relay, started_threads
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(120)

SECRET = "the-stage-secret"
SETTINGS = EdgeSettings(window_bytes=1 << 20, max_outage_s=30, retransmit_s=1.0, ready_timeout_s=30)
_jobs = itertools.count()


def proxy_for(tmp_path: Path, job_id: str, edges: set[str], switch_address: str, token: str) -> StageProxy:
    proxy = StageProxy(
        str(tmp_path / f"{job_id}.sock"),
        secret=SECRET,
        token=lambda: token,
        job_id=job_id,
        edges=edges,
        switch_address=switch_address,
        data_address=None,
        dataset="",
    )
    proxy.start()
    return proxy


@pytest.mark.parametrize("ready", [True, False], ids=["after-ready", "instead-of-ready"])
def test_a_switch_sending_garbage_while_the_proxy_closes_a_dead_stages_edges_ends_that_edge_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, ready: bool
) -> None:
    with hostile_relay(NOT_AN_EDGE_MESSAGE, ready=ready) as (relay, address):
        proxy = proxy_for(tmp_path, "job", {"first", "second"}, address, "token")
        before = set(threading.enumerate())
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="services.trainer.stage_proxy"):
            proxy.tell_peers({"first": "b", "second": "b"}, 0, "the stage process was killed")
        took = time.monotonic() - started
        assert [o.edge for o in relay.opens] == ["first", "second"]  # the second edge was still told
        assert took < TELL_TIMEOUT_S / 4, f"tell_peers took {took:.1f} s"
        warnings = [r.getMessage() for r in caplog.records if r.name == "services.trainer.stage_proxy"]
        named = "closing an edge for its stage: the switch sent a message that is not an EdgeMessage: "
        named += "Error parsing message with type 'nebula.v1.EdgeMessage'"
        assert len(warnings) == 2 and all(w.startswith(named) for w in warnings), warnings
        wait_for(lambda: relay.ended == 2, 10, "the proxy to cancel both calls")
        wait_for(lambda: not started_threads(before), 10, "the calls' threads to end")
        proxy.stop()


class Recorder:
    """A transport handler that keeps what happened, with the reasons of closes."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def on_ready(self, ready: relay_pb2.EdgeReady) -> None:
        self.log.append("ready")

    def on_message(self, message: relay_pb2.EdgeMessage) -> None:
        if message.WhichOneof("body") == "close":
            self.log.append(f"close: {message.close.reason}")

    def on_down(self, reason: str) -> None:
        self.log.append(f"down: {reason}")

    def on_failed(self, reason: str) -> None:
        self.log.append(f"failed: {reason}")


@pytest.mark.parametrize(
    ("garbage", "refusal"),
    [
        pytest.param(NOT_AN_EDGE_MESSAGE, "bytes that are not an edge message", id="not-an-edge-message"),
        pytest.param(
            CORRUPT_CHUNK,
            "an invalid framed chunk (framed chunk has field number 0, which protobuf does not allow)",
            id="corrupt-framed-chunk",
        ),
    ],
)
def test_a_stage_sending_garbage_fails_its_edge_named_and_the_proxy_serves_its_other_edge(
    tmp_path: Path, switches: SwitchPair, garbage: bytes, refusal: str
) -> None:
    job = f"proxy-{next(_jobs)}"
    proxy = proxy_for(tmp_path, job, {"bad", "good"}, switches.addresses[0], switches.tokens[0])
    try:
        # The hostile stage's end of "bad" goes through the proxy; its peer is on the other cluster.
        peer, stage = Recorder(), Recorder()
        peer_transport = GrpcEdgeTransport(switches.addresses[1], switches.tokens[1], job, "bad")
        stage_transport = GrpcEdgeTransport(proxy.address, SECRET, job, "bad")
        handlers: tuple[TransportHandler, TransportHandler] = (peer, stage)
        peer_transport.start(handlers[0])
        stage_transport.start(handlers[1])
        wait_for(lambda: "ready" in stage.log and "ready" in peer.log, 30, "both ends of 'bad' ready")
        stage_transport.send(garbage)
        wait_for(lambda: any(e.startswith("failed") for e in stage.log), 30, "the stage's edge to fail")
        assert stage.log == [
            "ready",
            f"failed: switch refused edge 'bad': INVALID_ARGUMENT: refused: the stream sent {refusal}",
        ]
        wait_for(lambda: any(e.startswith("close") for e in peer.log), 30, "the peer to hear of it")
        assert f"close: the other cluster's stage sent {refusal}; its switch closed the edge" in peer.log
        peer_transport.shutdown()
        stage_transport.shutdown()

        # The same proxy still carries the stage's other edge.
        def open_end(index: int) -> EdgeConnection:
            transport = (
                GrpcEdgeTransport(proxy.address, SECRET, job, "good")
                if index == 0
                else GrpcEdgeTransport(switches.addresses[1], switches.tokens[1], job, "good")
            )
            return edge_end(transport, job, "good", index, SETTINGS)

        up, down = open_pair(open_end)
        try:
            down.send_signal(relay_pb2.SIGNAL_KIND_READY, 0, [1.5])
            assert up.receive_signal(relay_pb2.SIGNAL_KIND_READY, 0, timeout=30) == [1.5]
        finally:
            up.abort("test over")
            down.abort("test over")
    finally:
        proxy.stop()
