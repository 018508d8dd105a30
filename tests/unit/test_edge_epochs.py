"""Edge epochs (relay.proto, "Epochs"): how an edge end learns its attempt is void; the memory link's rules.

The session half uses a scripted transport (the test plays the switch); the memory half checks
that ``MemoryLink`` applies the switches' epoch rules, which the pipeline recovery tests rely on.
"""

from __future__ import annotations

import threading

import pytest

from nebula_common.proto.nebula.v1 import relay_pb2
from services.trainer.edge import (
    EdgeClosedError,
    EdgeConnection,
    EdgeOutage,
    EdgeRestartRequired,
    EdgeSettings,
    renewed,
)
from services.trainer.edge.memory import MemoryLink
from services.trainer.edge.session import TransportHandler
from tests.support.edges import memory_pair, wait_for
from tests.unit.test_edge_session import ScriptedTransport

pytestmark = pytest.mark.timeout(60)
SETTINGS = EdgeSettings(window_bytes=1 << 20, retransmit_s=30.0, max_outage_s=30.0, ready_timeout_s=5)
RESUME, READY = relay_pb2.SIGNAL_KIND_RESUME, relay_pb2.SIGNAL_KIND_READY


class EpochTransport(ScriptedTransport):
    """A switch whose route is at ``route_epoch`` and whose link is ``link_up`` at open."""

    def __init__(self, route_epoch: int = 0, link_up: bool = True) -> None:
        super().__init__()
        self.route_epoch, self.link_up, self.shut = route_epoch, link_up, False

    def start(self, handler: TransportHandler) -> None:
        self.handler = handler
        ready = relay_pb2.EdgeReady(max_window_bytes=1 << 20, link_up=self.link_up, epoch=self.route_epoch)
        handler.on_ready(ready)

    def shutdown(self) -> None:
        self.shut = True


def blocked_receive(edge: EdgeConnection) -> tuple[threading.Thread, list[BaseException]]:
    raised: list[BaseException] = []

    def receive() -> None:
        try:
            edge.receive_signal(READY, 0, timeout=30)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    return thread, raised


def test_an_edge_restart_wakes_a_blocked_receive_with_the_epoch_and_sends_no_close() -> None:
    transport = EpochTransport()
    edge = EdgeConnection(transport, job_id="j", edge="e", upstream=True, settings=SETTINGS, epoch=0)
    thread, raised = blocked_receive(edge)
    transport.deliver(relay_pb2.EdgeMessage(restart=relay_pb2.EdgeRestart(epoch=3, reason="b restarted")))
    thread.join(5)
    assert len(raised) == 1 and isinstance(raised[0], EdgeRestartRequired), raised
    assert isinstance(raised[0], EdgeClosedError)  # callers that know no epochs still see a closed edge
    assert raised[0].epoch == 3 and "b restarted" in str(raised[0])
    assert transport.closes == [] and transport.shut  # a void stream: nothing more goes out on it
    with pytest.raises(EdgeRestartRequired):  # every later call raises the same kind
        edge.send_signal(READY)


def test_a_ready_of_a_higher_epoch_fails_the_open_with_restart_required() -> None:
    with pytest.raises(EdgeRestartRequired) as raised:
        EdgeConnection(EpochTransport(route_epoch=2), job_id="j", edge="e", upstream=False, epoch=1)
    assert raised.value.epoch == 2


def test_a_ready_of_our_own_or_a_lower_epoch_is_fine() -> None:
    for route in (0, 1):
        edge = EdgeConnection(EpochTransport(route_epoch=route), job_id="j", edge="e", upstream=True, epoch=1)
        assert edge.session.link_up and edge.epoch == 1


def test_an_outage_past_the_limit_raises_edge_outage_without_telling_the_peer() -> None:
    settings = EdgeSettings(window_bytes=1 << 20, max_outage_s=0.2, ready_timeout_s=5)
    transport = EpochTransport()
    edge = EdgeConnection(transport, job_id="j", edge="e", upstream=True, settings=settings)
    thread, raised = blocked_receive(edge)
    transport.deliver(relay_pb2.EdgeMessage(notice=relay_pb2.LinkNotice(up=False, reason="cut")))
    thread.join(10)
    assert len(raised) == 1 and isinstance(raised[0], EdgeOutage), raised
    assert "WAN link to the peer cluster down" in str(raised[0])
    assert transport.closes == []


def test_a_new_epoch_waits_for_the_link_without_a_deadline_then_the_limit_applies() -> None:
    settings = EdgeSettings(window_bytes=1 << 20, max_outage_s=0.2, ready_timeout_s=5)
    transport = EpochTransport(route_epoch=1, link_up=False)
    edge = EdgeConnection(transport, job_id="j", edge="e", upstream=True, settings=settings, epoch=1)
    waiter = threading.Thread(target=edge.session.wait_link_up, daemon=True)
    waiter.start()
    # Well past max_outage_s with the link down since the open: the edge still waits.
    wait_for(lambda: edge.session.outage_seconds() > 4 * settings.max_outage_s, 5, "a long outage")
    assert waiter.is_alive() and not edge.session._failed
    transport.deliver(relay_pb2.EdgeMessage(notice=relay_pb2.LinkNotice(up=True)))
    waiter.join(5)
    assert not waiter.is_alive()
    thread, raised = blocked_receive(edge)
    transport.deliver(relay_pb2.EdgeMessage(notice=relay_pb2.LinkNotice(up=False, reason="cut again")))
    thread.join(10)
    assert len(raised) == 1 and isinstance(raised[0], EdgeOutage), raised


def test_wait_link_up_is_cancellable() -> None:
    transport = EpochTransport(route_epoch=1, link_up=False)
    edge = EdgeConnection(transport, job_id="j", edge="e", upstream=True, settings=SETTINGS, epoch=1)
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            edge.session.wait_link_up()
        except BaseException as exc:
            raised.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    edge.abort("cancelled")
    waiter.join(5)
    assert len(raised) == 1 and type(raised[0]) is EdgeClosedError and "cancelled" in str(raised[0])


def test_renewed_keeps_kind_and_content() -> None:
    again = renewed(EdgeRestartRequired(4, "why"))
    assert isinstance(again, EdgeRestartRequired) and again.epoch == 4 and str(again) == "why"
    assert type(renewed(EdgeOutage("long"))) is EdgeOutage
    assert type(renewed(EdgeClosedError("x"))) is EdgeClosedError


# ---------------------------------------------------------------------- the memory link's epoch rules


def test_memory_link_a_restarted_end_restarts_the_other_side_which_then_gets_its_items() -> None:
    link = MemoryLink()
    up, down = memory_pair(link, SETTINGS)
    down.send_signal(READY)
    assert up.receive_signal(READY, timeout=5) == []
    down.session.transport.vanish()  # type: ignore[attr-defined]  # a dead process: no close
    up_thread, raised = blocked_receive(up)
    assert up_thread.is_alive()  # the survivor notices nothing while nobody re-attaches
    new_down = EdgeConnection(
        link.open_end(1, 1), job_id="j", edge="e", upstream=False, settings=SETTINGS, epoch=1
    )
    new_down.send_signal(RESUME, 1, [2.0, 4.0])  # crosses the link: the upstream's side learns epoch 1
    up_thread.join(5)
    assert len(raised) == 1 and isinstance(raised[0], EdgeRestartRequired) and raised[0].epoch == 1
    assert link.route_epoch == [1, 1] and link.restarts_sent == 1
    new_up = EdgeConnection(
        link.open_end(0, 1), job_id="j", edge="e", upstream=True, settings=SETTINGS, epoch=1
    )
    assert new_up.receive_signal(RESUME, 1, timeout=5) == [2.0, 4.0]  # held until epoch 1 attached
    new_up.send_signal(RESUME, 1, [4.0])
    assert new_down.receive_signal(RESUME, 1, timeout=5) == [4.0]


def test_memory_link_items_of_an_older_epoch_are_dropped_and_late_openers_restarted() -> None:
    link = MemoryLink()
    up, down = memory_pair(link, SETTINGS)
    new_up = link.open_end(0, 2)
    EdgeConnection(new_up, job_id="j", edge="e", upstream=True, settings=SETTINGS, epoch=2)
    thread, raised = blocked_receive(up)  # the old upstream end: replaced on its side, restarted
    thread.join(5)
    assert raised and isinstance(raised[0], EdgeRestartRequired) and raised[0].epoch == 2
    with pytest.raises(EdgeRestartRequired):  # an opener below the route's epoch: ready, then restart
        EdgeConnection(link.open_end(0, 1), job_id="j", edge="e", upstream=True, settings=SETTINGS, epoch=1)
    # The new end's first ack crossed the link: the downstream side learnt epoch 2 and restarts its end.
    wait_for(lambda: link.route_epoch == [2, 2], 5, "the downstream side to learn epoch 2")
    before = link.stale_dropped
    thread, raised = blocked_receive(down)
    thread.join(5)
    assert raised and isinstance(raised[0], EdgeRestartRequired)
    straggler = relay_pb2.EdgeMessage(signal=relay_pb2.EdgeSignal(seq=9, kind=READY))
    link.carry(down.session.transport, straggler)  # type: ignore[arg-type]  # old epoch: dropped
    assert link.stale_dropped == before + 1


def test_memory_link_during_a_cut_a_new_epoch_stays_on_its_own_side() -> None:
    link = MemoryLink()
    _, down = memory_pair(link, SETTINGS)
    link.cut()
    new_up = EdgeConnection(
        link.open_end(0, 1), job_id="j", edge="e", upstream=True, settings=SETTINGS, epoch=1
    )
    assert not new_up.session.link_up and link.route_epoch == [1, 0]
    new_up.send_signal(RESUME, 1, [])  # queued: the link is down
    link.restore()
    wait_for(lambda: link.route_epoch == [1, 1], 5, "epoch 1 to cross once the link is back")
    thread, raised = blocked_receive(down)
    thread.join(5)
    assert raised and isinstance(raised[0], EdgeRestartRequired)


class SilentTransport(EpochTransport):
    """A switch that never answers the open."""

    def start(self, handler: TransportHandler) -> None:
        self.handler = handler


@pytest.mark.parametrize(("epoch", "kind"), [(0, EdgeClosedError), (1, EdgeOutage)])
def test_an_unanswered_open_shuts_its_transport_and_is_an_outage_only_in_a_new_epoch(
    epoch: int, kind: type[EdgeClosedError]
) -> None:
    transport = SilentTransport()
    settings = EdgeSettings(ready_timeout_s=0.2)
    with pytest.raises(EdgeClosedError, match="switch did not open edge 'e' within") as raised:
        EdgeConnection(transport, job_id="j", edge="e", upstream=True, settings=settings, epoch=epoch)
    assert type(raised.value) is kind
    assert transport.shut  # no transport left re-dialling for an edge nobody holds
