"""The trainer's end of one job edge (edge protocol 2; see ``session`` for the delivery contract).

* ``session``: ``EdgeSession``, sequence, credit, acks, replay and outage handling, transport-agnostic,
  in parts of one concern each: ``send_window`` (numbering, credit, the buffer of unacknowledged
  items), ``replay`` (rewinds and the retransmit timeout), ``receive_window`` (in-order acceptance,
  reassembly, acks and grants), ``link_state`` (link up/down, outages, how the edge ended) and
  ``tensor_frames`` (the messages a tensor travels as, its reassembly buffer);
* ``settings``, ``errors``, ``transport``: the tunables, how an edge ends, the interface transports
  implement;
* ``connection``: ``EdgeConnection``, the tensor/signal API the pipeline loop uses (it owns
  the edge's codec streams);
* ``grpc_transport``: the Relay.OpenEdge stream to this cluster's switch, reconnecting;
* ``records_transport``: the edge as records on connections to the switch's edge socket, which a stage
  process asks its trainer for (``socket_request``);
* ``memory``: a connected in-memory pair with fault controls, for tests.
"""

from __future__ import annotations

from collections.abc import Callable

from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.edge.connection import BACKWARD, FORWARD, EdgeConnection, EdgeStats
from services.trainer.edge.errors import (
    EdgeClosedError,
    EdgeOutage,
    EdgeRestartRequired,
    EdgeTimeout,
    renewed,
)
from services.trainer.edge.grpc_transport import GrpcEdgeTransport
from services.trainer.edge.records_transport import Connector, RecordsEdgeTransport
from services.trainer.edge.session import EdgeSession
from services.trainer.edge.settings import INITIAL_WINDOW_BYTES, EdgeSettings

EdgeFactory = Callable[[trainer_pb2.StageSpec, EdgeSettings, int], EdgeConnection]
"""Opens a stage's edge end: (stage spec, settings, epoch) -> a started ``EdgeConnection``."""


def stage_edge(
    spec: trainer_pb2.StageSpec, transport: object, settings: EdgeSettings, epoch: int = 0
) -> EdgeConnection:
    """The edge end of ``spec``'s stage over ``transport`` (opened with ``epoch``), with the spec's codecs."""
    return EdgeConnection(
        transport,  # type: ignore[arg-type]
        job_id=spec.job_id,
        edge=spec.edge,
        upstream=spec.program.role == "upstream",
        codec_forward=spec.codec_forward or "none",
        codec_backward=spec.codec_backward or "none",
        settings=settings,
        epoch=epoch,
    )


def grpc_edge_factory(switch_address: str, token: str | Callable[[], str]) -> EdgeFactory:
    """The default factory: the stage's edge through this cluster's switch (Relay/OpenEdge).

    ``token`` may be a callable, read at every open: a stage's job token is renewed while it runs.
    """

    def open_edge(spec: trainer_pb2.StageSpec, settings: EdgeSettings, epoch: int) -> EdgeConnection:
        transport = GrpcEdgeTransport(
            switch_address, token, spec.job_id, spec.edge, epoch=epoch, peer_cluster=spec.peer_cluster
        )
        return stage_edge(spec, transport, settings, epoch)

    return open_edge


def records_edge_factory(connect: Connector) -> EdgeFactory:
    """A stage process's factory when its trainer names a switch edge socket: each edge as records on
    connections ``connect`` returns (``socket_request.EdgeSocketRequester``: asked of the trainer)."""

    def open_edge(spec: trainer_pb2.StageSpec, settings: EdgeSettings, epoch: int) -> EdgeConnection:
        transport = RecordsEdgeTransport(
            connect, spec.job_id, spec.edge, epoch=epoch, peer_cluster=spec.peer_cluster
        )
        return stage_edge(spec, transport, settings, epoch)

    return open_edge


__all__ = [
    "BACKWARD",
    "FORWARD",
    "INITIAL_WINDOW_BYTES",
    "EdgeClosedError",
    "EdgeConnection",
    "EdgeFactory",
    "EdgeOutage",
    "EdgeRestartRequired",
    "EdgeSession",
    "EdgeSettings",
    "EdgeStats",
    "EdgeTimeout",
    "GrpcEdgeTransport",
    "RecordsEdgeTransport",
    "grpc_edge_factory",
    "records_edge_factory",
    "renewed",
    "stage_edge",
]
