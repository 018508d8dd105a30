"""The trainer's side of a stage's edge connections: checked, ticketed, connected, passed as a descriptor.

With a switch edge socket configured (``NEBULA_TRAINER_SWITCH_EDGE_SOCKET``) a stage process carries
its edges as records straight to the switch (``edge/records_transport.py``), but it cannot reach the
switch's socket: its box has no network and no view of it, and it holds no token. On the stage's
request (``edge/socket_request.py``, its own ``SOCK_SEQPACKET`` socketpair) the trainer:

1. checks the open exactly as its proxy checks a gRPC one (``StageProxy.edge_refusal``: the stage's own
   job and edges only), reporting a refusal the same way (``stage.refused``);
2. asks the switch for a one-time ticket with the stage's job token and its own mutual-TLS identity
   (``StageProxy.issue_ticket``, ``Relay/IssueEdgeTicket``); a refusal is passed on with its status;
3. connects to the switch's edge socket, presents the ticket as the first record, and passes the
   connected socket to the stage (``SCM_RIGHTS``), closing its own copy. On a TCP edge port (the switch
   on another host: Kubernetes) the connection is mutual TLS 1.3 with the trainer's internal identity
   and then sealed records (``nebula_common/rpc/edge_tls.py``); the stage gets that one connection's
   record state beside the socket, never the trainer's key.

The stage so sees its connection and nothing else: not the token, not the socket's path. A socket
that is missing or refuses is answered ``UNAVAILABLE`` naming why (the stage retries with backoff);
there is no other carrier to fall back to.

The trainer presents a ticket only to its switch: the listening end must be a socket file owned by the
user it runs as, and that user must be root or the trainer's own (the two users a switch runs as beside
its trainer: ``nebula local up`` as root boxes the trainer under a user of its own and leaves the switch
root; otherwise and in compose both share one user). The kernel's word on the peer
(``SO_PEERCRED``) decides, not the path: a process of any other user that binds or replaces the socket
gets no ticket and no stage connection.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import struct
import threading

import grpc

from nebula_common.rpc.edge_tls import UNIX, dial_edge, edge_address
from nebula_common.rpc.internal_tls import ClientTls, InternalTlsError, process_client_tls
from nebula_common.rpc.unix_paths import connect_unix
from services.trainer.edge.socket_request import MAX_REQUEST_BYTES, parse_request, reply
from services.trainer.stage_proxy import StageProxy

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 10.0
SOCKET_BUFFER_BYTES = 4 << 20
"""Send and receive buffer of an edge connection (the kernel's ~208 KiB default blocks a chunk)."""


def connect_edge_socket(path: str, ticket: bytes) -> socket.socket:
    """A connection to the switch's edge socket at ``path`` with ``ticket`` presented (OSError if not)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        sock.settimeout(CONNECT_TIMEOUT_S)
        connect_unix(sock, path)  # at any depth (``unix_paths.py``)
        check_switch_peer(sock, path)
        sock.sendall(len(ticket).to_bytes(4, "big") + ticket)
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return sock


def connect_edge(
    address: str, ticket: bytes, tls: ClientTls | None = None
) -> tuple[socket.socket, dict | None]:
    """A ticketed connection to the switch's edge socket at ``address`` (a path or host:port) and, on
    TCP, the sealed records' state to hand over with it (OSError, InternalTlsError if not). ``tls``:
    the trainer's identity (default: this process's, the trainer service's own)."""
    if edge_address(address, "NEBULA_TRAINER_SWITCH_EDGE_SOCKET")[0] == UNIX:
        return connect_edge_socket(address, ticket), None
    tls = tls or process_client_tls()
    if tls is None:
        raise InternalTlsError("a TCP edge socket needs this trainer's internal TLS identity")
    return dial_edge(address, tls, ticket, CONNECT_TIMEOUT_S)


def check_switch_peer(sock: socket.socket, path: str) -> None:
    """Raise PermissionError unless ``sock``'s peer may be this trainer's switch (see the module doc)."""
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    trusted = {0, os.geteuid()}
    if uid not in trusted:
        raise PermissionError(
            f"the process listening there runs as user {uid}, not as root or this trainer's user "
            f"{os.geteuid()}: not this cluster's switch, no ticket sent"
        )
    info = os.lstat(path)
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != uid:
        raise PermissionError(
            f"the file there is not a socket of its listener's user {uid} (owner {info.st_uid}, mode "
            f"{stat.filemode(info.st_mode)}): no ticket sent"
        )


class StageEdgeFds:
    """Answers one stage's edge requests on ``sock`` (see the module doc), on a thread of its own."""

    def __init__(
        self,
        sock: socket.socket,
        proxy: StageProxy,
        edge_socket: str,
        job_id: str,
        tls: ClientTls | None = None,
    ) -> None:
        self._sock = sock
        self._tls = tls
        self._proxy = proxy
        self._edge_socket = edge_socket
        self._job_id = job_id
        self._thread = threading.Thread(target=self._serve, name=f"stage-edges-{job_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop answering (the stage is gone); its connections are its own and end with it."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(5)
        self._sock.close()

    def _serve(self) -> None:
        while True:
            try:
                packet = self._sock.recv(MAX_REQUEST_BYTES + 8)
            except OSError:
                return
            if not packet:
                return
            self._answer(packet)

    def _answer(self, packet: bytes) -> None:
        try:
            request_id, opened = parse_request(packet)
        except ValueError as exc:
            self._proxy.refused(str(exc))
            self._reply(0, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        refusal = self._proxy.edge_refusal(opened)
        if refusal is not None:
            self._proxy.refused(refusal)
            self._reply(request_id, grpc.StatusCode.PERMISSION_DENIED, refusal)
            return
        try:
            conn, sealing = connect_edge(self._edge_socket, self._proxy.issue_ticket(opened), self._tls)
        except grpc.RpcError as exc:
            self._reply(request_id, exc.code(), exc.details() or "")
            return
        except (OSError, InternalTlsError) as exc:
            reason = f"the switch's edge socket {self._edge_socket}: {exc}"
            log.warning(
                "no edge connection for a stage", extra={"fields": {"job_id": self._job_id, "reason": reason}}
            )
            self._reply(request_id, grpc.StatusCode.UNAVAILABLE, reason)
            return
        try:
            answer = reply(request_id, grpc.StatusCode.OK, sealing=sealing)
            socket.send_fds(self._sock, [answer], [conn.fileno()])
        except OSError as exc:
            log.warning("could not pass an edge connection to its stage: %s", exc)
        finally:
            conn.close()

    def _reply(self, request_id: int, code: grpc.StatusCode, message: str) -> None:
        with contextlib.suppress(OSError):
            self._sock.send(reply(request_id, code, message))


__all__ = ["StageEdgeFds", "check_switch_peer", "connect_edge", "connect_edge_socket"]
