"""A stage process's one way out: its own edges to the switch and its own dataset's batches.

A stage process (``stage_process``) holds no certificate, no token and no route to any port of the
cluster: in the strongest confinement it has no network at all. Its trainer serves it this proxy on a
Unix socket in a directory only that stage can reach, and forwards exactly what the stage needs, on
the trainer's mutual-TLS identity and with the stage owner's token, which the stage never sees:

* ``Relay/OpenEdge`` for the stage's own job and edges only (the first message, ``EdgeOpen``, names
  them; any other job or edge is refused);
* ``Data/ListDatasets`` and ``Data/ReadBatch`` of the one dataset the stage's spec names, and only
  when it names one (the data service re-checks the grant on every batch, as before).

Every call must carry the stage's secret as its bearer token (given to the stage over its control
channel at start): a process that found the socket but is not that stage is refused. Payloads pass
through as bytes, never parsed beyond the checks above, so the proxy adds one local copy per message.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from nebula_common.proto.nebula.v1 import data_pb2, relay_pb2
from nebula_common.rpc import bearer_metadata
from nebula_common.rpc.framing import LINK_FRAMING_VERSION, is_framed
from nebula_common.rpc.internal_tls import internal_channel
from nebula_common.rpc.metadata import bearer_token_from_metadata

log = logging.getLogger(__name__)

OPEN_EDGE = "/nebula.v1.Relay/OpenEdge"
ISSUE_EDGE_TICKET = "/nebula.v1.Relay/IssueEdgeTicket"
TICKET_CALL_TIMEOUT_S = 20.0
LIST_DATASETS = "/nebula.v1.Data/ListDatasets"
READ_BATCH = "/nebula.v1.Data/ReadBatch"
_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
]


class StageProxy:
    """Serves one stage process on ``unix:<socket_path>`` (see the module doc)."""

    def __init__(
        self,
        socket_path: str,
        *,
        secret: str,
        token: Callable[[], str],
        job_id: str,
        edges: set[str],
        switch_address: str,
        data_address: str | None,
        dataset: str,
        on_refusal: Callable[[str], None] | None = None,
    ) -> None:
        self.address = f"unix:{socket_path}"
        self._secret = secret
        self._token = token
        self._job_id = job_id
        self._edges = edges
        self._dataset = dataset
        self._on_refusal = on_refusal
        self._lock = threading.Lock()
        self._latest: dict[str, _LiveEdge] = {}  # the last stream of each edge the stage opened
        self._switch = internal_channel(switch_address, service="switch", options=_OPTIONS)
        self._data = (
            internal_channel(data_address, service="data", options=_OPTIONS)
            if data_address and dataset
            else None
        )
        self._executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix=f"stage-proxy-{job_id}")
        self._server = grpc.server(
            self._executor,
            handlers=[_Handlers(self)],
            options=_OPTIONS,
        )
        self._server.add_insecure_port(self.address)

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        """Ends every call the stage has open and the upstream channels."""
        with self._lock:
            live = list(self._latest.values())
        deadline = time.monotonic() + CLOSED_CALL_WAIT_S
        for edge in live:
            if edge.call is None:
                continue
            # A stream that carried the stage's close ends once the switch has passed it on and the
            # other side closed too; cancelling it sooner could reach the switch before the close
            # (it would take the stream for a vanished trainer and hold the route, telling nobody).
            if edge.sent_close:
                edge.ended.wait(max(0.0, deadline - time.monotonic()))
            edge.call.cancel()
        self._server.stop(grace=None).wait(5)
        # Its worker threads are not daemons: left idle, they would hold the trainer's exit.
        self._executor.shutdown(wait=False)
        self._switch.close()
        if self._data is not None:
            self._data.close()

    def tell_peers(self, peers: dict[str, str], epoch: int, reason: str) -> None:
        """Close, as an error with ``reason``, each edge the stage could not close itself.

        A stage process that died (killed, out of memory) leaves its edge open, or never opened
        (killed while its first stream was connecting); the other cluster's stage would wait for it
        until its outage limit or ready timeout. For each such edge the trainer opens it again, on
        the stage's behalf (a reconnect supersedes a stream the switch still holds), and closes it.
        ``peers`` maps each edge of the stage to its peer cluster.
        """
        for edge, peer_cluster in peers.items():
            with self._lock:
                live = self._latest.get(edge)
            if live is not None and live.call is not None:
                if live.sent_close:  # the switch ends it once it passed the close on and the peer closed
                    live.ended.wait(CLOSED_CALL_WAIT_S)
                if live.ended.is_set() and live.call.code() == grpc.StatusCode.OK:
                    continue  # closed on both sides: nothing to say
                live.call.cancel()
            opening = relay_pb2.EdgeMessage(
                open=relay_pb2.EdgeOpen(
                    job_id=self._job_id,
                    edge=edge,
                    reconnect=live is not None,
                    epoch=epoch,
                    link_framing=LINK_FRAMING_VERSION,
                    peer_cluster=peer_cluster,
                )
            )
            closing = relay_pb2.EdgeMessage(close=relay_pb2.EdgeClose(reason=reason, error=True))
            ready, over = threading.Event(), threading.Event()

            def requests(
                opening: relay_pb2.EdgeMessage = opening,
                closing: relay_pb2.EdgeMessage = closing,
                ready: threading.Event = ready,
                over: threading.Event = over,
            ) -> Iterator[bytes]:
                yield opening.SerializeToString()
                # As any edge: nothing before the switch's READY (``ready`` is also set, with ``over``,
                # to end this wait when the call is over without one).
                if ready.wait(TELL_TIMEOUT_S) and not over.is_set():
                    yield closing.SerializeToString()

            log.info(
                "closing an edge for its stage",
                extra={"fields": {"job_id": self._job_id, "edge": edge, "reconnect": live is not None}},
            )
            call = self._switch.stream_stream(OPEN_EDGE)(
                requests(), metadata=self._metadata(), timeout=TELL_TIMEOUT_S
            )
            try:
                for raw in call:  # until the switch ends the call (the close reached the other side)
                    if is_framed(raw):
                        continue
                    try:
                        message = relay_pb2.EdgeMessage.FromString(raw)
                    except DecodeError as exc:  # the switch breaks the protocol: give up on this edge
                        log.warning(
                            "closing an edge for its stage: the switch sent a message that is not an "
                            "EdgeMessage: %s",
                            exc,
                            extra={"fields": {"job_id": self._job_id, "edge": edge}},
                        )
                        break
                    if message.HasField("ready"):
                        ready.set()
            except grpc.RpcError as exc:
                log.warning(
                    "closing an edge for its stage: %s",
                    exc.details() or exc.code(),
                    extra={"fields": {"job_id": self._job_id, "edge": edge}},
                )
            finally:
                call.cancel()  # nothing of this call is left running (a no-op once the switch ended it)
                over.set()
                ready.set()

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return bearer_metadata(self._token())

    def _refuse(self, context: grpc.ServicerContext, code: grpc.StatusCode, reason: str) -> None:
        self.refused(reason)
        context.abort(code, reason)

    def refused(self, reason: str) -> None:
        """Log and report (``stage.refused``) a call of the stage that was refused."""
        log.warning("stage call refused", extra={"fields": {"job_id": self._job_id, "reason": reason}})
        if self._on_refusal is not None:
            self._on_refusal(reason)

    def edge_refusal(self, opened: relay_pb2.EdgeOpen) -> str | None:
        """Why the stage may not open ``opened`` (another job's or edge), None if it may: the one check
        of every open of the stage, on gRPC here or as records (``stage_edge_fds.py``)."""
        if opened.job_id != self._job_id or opened.edge not in self._edges:
            return f"stage of job {self._job_id!r} may not open edge {opened.edge!r} of job {opened.job_id!r}"
        return None

    def issue_ticket(self, opened: relay_pb2.EdgeOpen) -> bytes:
        """A one-time ticket for ``opened`` on the switch's edge socket, asked with the stage's token
        (``Relay/IssueEdgeTicket``); the open's own edge is noted, as a gRPC open's stream is, so
        ``tell_peers`` reopens it as a reconnect. grpc.RpcError as the switch refused it."""
        reply = self._switch.unary_unary(
            ISSUE_EDGE_TICKET,
            request_serializer=relay_pb2.EdgeTicketRequest.SerializeToString,
            response_deserializer=relay_pb2.EdgeTicket.FromString,
        )(relay_pb2.EdgeTicketRequest(open=opened), metadata=self._metadata(), timeout=TICKET_CALL_TIMEOUT_S)
        with self._lock:
            self._latest[opened.edge] = _LiveEdge()  # no call of ours: the stage holds the connection
        return bytes(reply.ticket)

    def authorised(self, metadata: Any) -> bool:
        presented = bearer_token_from_metadata(metadata) or ""
        return hmac.compare_digest(presented.encode(), self._secret.encode())

    # --- the forwarded methods -------------------------------------------------------------------

    def open_edge(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        first = next(requests, None)
        if first is None:
            return
        try:
            message = relay_pb2.EdgeMessage.FromString(first)
        except Exception:  # any undecodable first message is a refusal
            message = relay_pb2.EdgeMessage()
        if message.WhichOneof("body") != "open":
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "an edge stream must start with EdgeOpen")
        opened = message.open
        if (refusal := self.edge_refusal(opened)) is not None:
            self._refuse(context, grpc.StatusCode.PERMISSION_DENIED, refusal)
        live = _LiveEdge()
        with self._lock:
            self._latest[opened.edge] = live

        def forwarded() -> Iterator[bytes]:
            yield message.SerializeToString()
            for item in requests:
                live.sent_close = live.sent_close or _is_close(item)
                yield item

        live.call = call = self._switch.stream_stream(OPEN_EDGE)(forwarded(), metadata=self._metadata())
        call.add_done_callback(lambda _: live.ended.set())
        try:
            yield from call
        except grpc.RpcError as exc:
            if context.is_active():
                context.abort(exc.code(), exc.details() or "")

    def list_datasets(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return self._unary(LIST_DATASETS, request, context)

    def read_batch(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        ref = data_pb2.ReadBatchRequest.FromString(request).dataset
        if f"{ref.owner}/{ref.name}" != self._dataset:
            self._refuse(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"stage of job {self._job_id!r} may read only dataset {self._dataset!r}",
            )
        return self._unary(READ_BATCH, request, context)

    def _unary(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        if self._data is None:
            self._refuse(context, grpc.StatusCode.PERMISSION_DENIED, "this stage's spec names no dataset")
        assert self._data is not None
        try:
            return self._data.unary_unary(method)(request, metadata=self._metadata(), timeout=60)
        except grpc.RpcError as exc:
            context.abort(exc.code(), exc.details() or "")
            raise


CLOSED_CALL_WAIT_S = 5.0
"""How long the proxy's end waits for streams that carried the stage's close to be ended by the switch."""
TELL_TIMEOUT_S = 60.0
"""Bound of one ``tell_peers`` call: the switch ends it once the other side closed too, which can take
until the other cluster's stage is up (its module imported, its model built)."""


def _is_close(raw: bytes) -> bool:
    """Whether a message the stage sent is its EdgeClose (small control messages only are parsed)."""
    if len(raw) > 4096 or is_framed(raw):
        return False
    try:
        return relay_pb2.EdgeMessage.FromString(raw).WhichOneof("body") == "close"
    except Exception:  # not ours to judge: the switch checks every message
        return False


class _LiveEdge:
    """One edge stream of the stage, as the proxy carries it upstream."""

    def __init__(self) -> None:
        self.call: grpc.Call | None = None
        self.sent_close = False
        """The stage sent its EdgeClose on this stream (then nobody needs to speak for it)."""
        self.ended = threading.Event()


class _Handlers(grpc.GenericRpcHandler):
    def __init__(self, proxy: StageProxy) -> None:
        self._proxy = proxy

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        proxy = self._proxy
        if not proxy.authorised(details.invocation_metadata):
            return grpc.unary_unary_rpc_method_handler(_denied("the stage's secret is missing or wrong"))
        if details.method == OPEN_EDGE:
            return grpc.stream_stream_rpc_method_handler(proxy.open_edge)
        if details.method == LIST_DATASETS:
            return grpc.unary_unary_rpc_method_handler(proxy.list_datasets)
        if details.method == READ_BATCH:
            return grpc.unary_unary_rpc_method_handler(proxy.read_batch)
        return grpc.unary_unary_rpc_method_handler(_denied(f"method {details.method} is not a stage's"))


def _denied(reason: str) -> Callable[[bytes, grpc.ServicerContext], bytes]:
    def deny(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)
        raise AssertionError("unreachable")

    return deny


__all__ = ["StageProxy"]
