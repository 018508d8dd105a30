"""Edge ends for trainer tests: in-memory pairs, pairs through two real switches, and pipeline runs.

``run_stages`` runs both stages of a program job (e.g. the built-in ``numbers``) as real
``ProgramRunner``s in this process, on an in-memory edge pair, and records what each stage
received, so tests can check that every micro-batch was applied exactly once.
"""

from __future__ import annotations

import json
import socket
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nebula_common.pki import PkiLayout
from nebula_common.pki.service_identity import ensure_service_certificates
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.rpc.internal_tls import ClientTls, forget_endpoint, set_process_client_tls, trust_endpoint
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.sdk.jobs import ProgramJob
from services.switch.config import SwitchSettings
from services.trainer.edge import EdgeConnection, EdgeSettings, GrpcEdgeTransport, stage_edge
from services.trainer.edge.memory import MemoryLink
from services.trainer.edge.records_transport import RecordsEdgeTransport
from services.trainer.edge.socket_request import EdgeSocketRequester
from services.trainer.runtime.stage import ProgramRunner
from services.trainer.stage_edge_fds import StageEdgeFds
from services.trainer.stage_proxy import StageProxy
from tests.support.accounts import ADMIN_PASSWORD, auth_settings
from tests.support.jobs import numbers_job
from tests.support.servers import AuthServerThread, SwitchThread, accepting_switch, running_auth
from tests.support.waiting import wait_for


def in_threads(*calls: Callable[[], object], timeout: float = 90.0) -> list[object]:
    """Run ``calls`` concurrently, one thread each; their results in order, or the first error raised."""
    results: list[object] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            results[index] = calls[index]()
        except BaseException as exc:  # reported below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    if errors:
        raise errors[0]
    assert not any(thread.is_alive() for thread in threads), (
        f"a concurrent call did not finish in {timeout:.0f} s"
    )
    return results


def open_pair(
    open_end: Callable[[int], EdgeConnection],
) -> tuple[EdgeConnection, EdgeConnection]:
    """Open both ends concurrently (each waits for its ready); returns (upstream, downstream)."""
    up, down = in_threads(lambda: open_end(0), lambda: open_end(1), timeout=60)
    assert isinstance(up, EdgeConnection) and isinstance(down, EdgeConnection)
    return up, down


def edge_end(
    transport: Any,
    job_id: str,
    edge: str,
    index: int,
    settings: EdgeSettings,
    codec_forward: str = "none",
    codec_backward: str = "none",
) -> EdgeConnection:
    """End ``index`` of an edge pair (0 upstream, 1 downstream) on ``transport``."""
    return EdgeConnection(
        transport,
        job_id=job_id,
        edge=edge,
        upstream=index == 0,
        codec_forward=codec_forward,
        codec_backward=codec_backward,
        settings=settings,
    )


def memory_pair(
    link: MemoryLink,
    settings: EdgeSettings,
    codec_forward: str = "none",
    codec_backward: str = "none",
) -> tuple[EdgeConnection, EdgeConnection]:
    return open_pair(
        lambda index: edge_end(
            link.ends[index], "job", "up->down", index, settings, codec_forward, codec_backward
        )
    )


@dataclass
class SwitchPair:
    addresses: tuple[str, str]
    tokens: tuple[str, str]
    #: Each switch's edge socket (``switch_pair(edge_sockets=True)``); empty: not served.
    edge_sockets: tuple[str, str] = ("", "")
    #: Each cluster's auth service.
    auth_addresses: tuple[str, str] = ("", "")
    #: The switches themselves (their audit logs, routers).
    threads: tuple[SwitchThread, ...] = ()
    #: Each cluster's trainer identity (``switch_pair(edge_sockets="tcp")``: internal TLS on).
    trainer_tls: tuple[ClientTls | None, ClientTls | None] = (None, None)

    def transport(self, carrier: str, index: int, job_id: str, edge: str, epoch: int = 0) -> Any:
        """A transport of cluster ``index``'s end: ``grpc`` (OpenEdge) or ``records`` (the edge socket,
        through a trainer's real ticket and descriptor passing: ``stage_records_connector``)."""
        if carrier == "records":
            connect = stage_records_connector(self, index, job_id, {edge})
            return RecordsEdgeTransport(connect, job_id, edge, epoch=epoch)
        return GrpcEdgeTransport(self.addresses[index], self.tokens[index], job_id, edge, epoch=epoch)

    def edge_pair(
        self,
        job_id: str,
        settings: EdgeSettings,
        codec_forward: str = "none",
        codec_backward: str = "none",
        carrier: str = "grpc",
    ) -> tuple[EdgeConnection, EdgeConnection]:
        def open_end(index: int) -> EdgeConnection:
            transport = self.transport(carrier, index, job_id, "up->down")
            return edge_end(transport, job_id, "up->down", index, settings, codec_forward, codec_backward)

        return open_pair(open_end)


def stage_proxy(
    pair: SwitchPair, index: int, job_id: str, edges: set[str], refusals: list[str] | None = None
) -> StageProxy:
    """A trainer's stage proxy for job ``job_id`` in cluster ``index`` (its token; refusals noted)."""
    return StageProxy(
        str(Path(tempfile.mkdtemp(prefix="nebula-records-")) / "proxy.sock"),
        secret="unused",
        token=lambda: pair.tokens[index],
        job_id=job_id,
        edges=edges,
        switch_address=pair.addresses[index],
        data_address=None,
        dataset="",
        **({"on_refusal": refusals.append} if refusals is not None else {}),
    )


def stage_records_connector(
    pair: SwitchPair,
    index: int,
    job_id: str,
    edges: set[str],
    *,
    edge_socket: str = "",
    refusals: list[str] | None = None,
    own_identity: bool = False,
) -> EdgeSocketRequester:
    """What a stage process gets: a requester on a socketpair whose other end a trainer's ``StageEdgeFds``
    answers (checks, a ticket with cluster ``index``'s token, the connection passed as a descriptor).

    ``edge_socket``: another socket than the switch's; ``own_identity``: the trainer dials with the
    process's identity, as the trainer service does, instead of the pair's trainer identity."""
    proxy = stage_proxy(pair, index, job_id, edges, refusals)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    tls = None if own_identity else pair.trainer_tls[index]
    StageEdgeFds(ours, proxy, edge_socket or pair.edge_sockets[index], job_id, tls=tls).start()
    return EdgeSocketRequester(theirs)


def _internal_tls(
    stack: ExitStack, pki: PkiLayout
) -> tuple[Callable[[str, str], dict[str, Any]], dict[str, ClientTls]]:
    """Internal identities of auth, switch and trainer in both clusters: each service's settings, and
    the trainer's client identity, which the test process presents to its cluster's ports
    (``trust_endpoint``; the process-wide identity is reset, as services started in one process
    overwrite it)."""
    identities = {c: ensure_service_certificates(pki.root, c, ("auth", "switch", "trainer")) for c in "ab"}
    trainers = {c: ClientTls.for_service(identities[c]["trainer"], c) for c in "ab"}
    stack.callback(set_process_client_tls, None)

    def settings(cluster: str, service: str) -> dict[str, Any]:
        return {"internal_tls_dir": identities[cluster][service].dir}

    return settings, trainers


@contextmanager
def switch_pair(work: Path, pki: PkiLayout, edge_sockets: bool | str = False) -> Iterator[SwitchPair]:
    """Clusters a and b, each an auth server and a switch; a dials b over mTLS. Admin tokens of each.

    ``edge_sockets``: each switch also serves its edge socket (``True``: ``work/<cluster>/edge.sock``;
    ``"tcp"``: a TCP port, with internal TLS on for every service, as in Kubernetes). With internal TLS
    ``addresses`` are the switches' service ports, reached with the trainer's identity.
    """
    with ExitStack() as stack:
        for cluster in "ab":
            (work / cluster).mkdir(parents=True, exist_ok=True)
        tcp = edge_sockets == "tcp"
        if tcp:
            internal, trainers = _internal_tls(stack, pki)
        else:
            internal, trainers = (lambda cluster, service: {}), {}
        sockets = tuple(
            "127.0.0.1:0" if tcp else str(work / c / "edge.sock") if edge_sockets else "" for c in "ab"
        )
        auths = {
            c: stack.enter_context(running_auth(auth_settings(work / c, c, **internal(c, "auth"))))
            for c in "ab"
        }
        auth_addresses = {c: _auth_address(auths[c], tcp) for c in "ab"}
        for c in trainers:
            for address in (auths[c].address, auth_addresses[c]):
                trust_endpoint(address, trainers[c])
                stack.callback(forget_endpoint, address)  # its port may next be anyone's
        b = stack.enter_context(
            accepting_switch(
                work / "b",
                pki.cluster("b"),
                "a",
                auth_addresses["b"],
                edge_socket=sockets[1],
                **internal("b", "switch"),
            )
        )
        paths = pki.cluster("a")
        a = SwitchThread(
            SwitchSettings(
                cluster_id="a",
                peer_cluster_id="b",
                link_role="dial",
                peer_address=f"127.0.0.1:{b.running.wan_port}",
                tls_cert=paths.switch_cert,
                tls_key=paths.switch_key,
                trust_bundle=paths.trust_bundle,
                auth_address=auth_addresses["a"],
                data_dir=work / "a" / "switch",
                metrics_port=-1,
                edge_socket=sockets[0],
                **internal("a", "switch"),
            )
        )
        stack.callback(a.stop)
        if tcp:
            set_process_client_tls(None)  # each service set its own; the test presents the trainer's
        switches = (a, b)
        addresses = tuple(_switch_address(switch, tcp) for switch in switches)
        for c, address, switch in zip("ab", addresses, switches, strict=True):
            if c in trainers:
                for trusted in (address, switch.internal_address):
                    trust_endpoint(trusted, trainers[c])
                    stack.callback(forget_endpoint, trusted)
        served = tuple(
            (switch.running.edge_socket.path if switch.running.edge_socket else "") if tcp else path
            for switch, path in zip(switches, sockets, strict=True)
        )
        wait_for(lambda: a.running.link.state.connected, 30, "the a-b switch link")
        tokens = []
        for cluster in "ab":
            with AuthClient(auths[cluster].address) as client:
                tokens.append(client.login("admin", ADMIN_PASSWORD).token)
        yield SwitchPair(
            (addresses[0], addresses[1]),
            (tokens[0], tokens[1]),
            (served[0], served[1]),
            (auths["a"].address, auths["b"].address),
            (a, b),
            (trainers.get("a"), trainers.get("b")),
        )


def _auth_address(auth: AuthServerThread, internal_tls: bool) -> str:
    """Where a switch asks auth for its token keys: the service port under internal TLS."""
    return f"127.0.0.1:{auth.service.ports['service_port']}" if internal_tls else auth.address


def _switch_address(switch: SwitchThread, internal_tls: bool) -> str:
    """Where a trainer opens edges and asks for tickets: the service port under internal TLS."""
    return (
        f"127.0.0.1:{switch.running.internal.ports['service']}" if internal_tls else switch.internal_address
    )


@dataclass
class StageRun:
    runner: ProgramRunner
    received: list[tuple[int, int]] = field(default_factory=list)
    received_tensors: list[torch.Tensor] = field(default_factory=list)
    sent_tensors: list[torch.Tensor] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)  # of every edge the runner opened

    @property
    def board(self) -> list[trainer_pb2.StageStatus]:
        return self.runner.board.since(0, 0)[1]

    def losses(self) -> dict[int, float]:
        return {int(s.steps_done) - 1: s.loss for s in self.board if s.HasField("loss")}

    def local_losses(self) -> dict[int, float]:
        return {int(s.steps_done) - 1: s.local_loss for s in self.board if s.HasField("local_loss")}

    def parameters(self) -> list[torch.Tensor]:
        assert self.runner.program is not None
        return [p.detach().clone() for p in self.runner.program.model.parameters()]

    @property
    def final(self) -> trainer_pb2.StageStatus:
        return self.runner.board.latest()


def stage_runner(
    job: ProgramJob,
    index: int,
    data_dir: Path,
    link: MemoryLink | SwitchPair,
    settings: EdgeSettings,
    *,
    epoch: int = 0,
    on_epoch: Callable[[int], None] | None = None,
    receive_ahead: int | None = None,
    carrier: str = "grpc",
) -> StageRun:
    """A ``ProgramRunner`` (not started) for the job's ``index``-th stage, recording its tensors.

    Its edge runs on the in-memory ``link`` or, given a ``SwitchPair``, through two real switches
    (stage ``index`` in cluster a or b) on ``carrier`` (``SwitchPair.transport``). Its data dir is
    ``data_dir / <stage name>``, so a runner made again for the same stage (a restarted trainer,
    ``epoch > 0``) finds the checkpoints of the one before.
    """
    name = job.spec.stages[index].name

    def open_edge(
        stage_spec: trainer_pb2.StageSpec, stage_settings: EdgeSettings, edge_epoch: int, run: StageRun
    ) -> EdgeConnection:
        transport: object
        if isinstance(link, SwitchPair):
            transport = link.transport(carrier, index, stage_spec.job_id, stage_spec.edge, edge_epoch)
        else:
            transport = link.ends[index] if edge_epoch == 0 else link.open_end(index, edge_epoch)
        edge = stage_edge(stage_spec, transport, stage_settings, edge_epoch)
        receive, send = edge.receive_tensor, edge.send_tensor

        def recording(step: int, micro_batch: int, *args: object, **kwargs: object) -> torch.Tensor:
            tensor = receive(step, micro_batch, *args, **kwargs)  # type: ignore[arg-type]
            run.received.append((step, micro_batch))
            run.received_tensors.append(tensor.clone())
            return tensor

        def sending(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
            run.sent_tensors.append(tensor.detach().clone())
            return send(tensor, *args, **kwargs)  # type: ignore[arg-type]

        edge.receive_tensor = recording  # type: ignore[method-assign]
        edge.send_tensor = sending  # type: ignore[method-assign]
        run.epochs.append(edge_epoch)
        return edge

    return runner_with_edges(
        job, name, data_dir, settings, open_edge, epoch=epoch, on_epoch=on_epoch, receive_ahead=receive_ahead
    )


def runner_with_edges(
    job: ProgramJob,
    name: str,
    data_dir: Path,
    settings: EdgeSettings,
    open_edge: Callable[[trainer_pb2.StageSpec, EdgeSettings, int, StageRun], EdgeConnection],
    **options: Any,
) -> StageRun:
    """A ``ProgramRunner`` (not started) for the job's stage ``name``, its edges opened by ``open_edge``.

    ``open_edge`` is the runner's edge factory plus the ``StageRun`` it belongs to (to record into).
    The runner is made as the trainer makes it, with a token, owner ``tester``, no data service, and
    data dir ``data_dir / name``; ``options`` go to ``ProgramRunner`` (``epoch``, ``on_epoch``, ...).
    """
    holder: list[StageRun] = []
    runner = ProgramRunner(
        job.stage_spec(name),
        "token",
        "unused:0",
        data_dir / name,
        "tester",
        edge_factory=lambda spec, edge_settings, epoch: open_edge(spec, edge_settings, epoch, holder[0]),
        edge_settings=settings,
        **options,
    )
    holder.append(StageRun(runner))
    return holder[0]


def run_stages(
    job: ProgramJob,
    data_dir: Path,
    link: MemoryLink,
    settings: EdgeSettings,
    *,
    during: Callable[[StageRun, StageRun, MemoryLink], None] | None = None,
    timeout: float = 240.0,
    receive_ahead: int | None = None,
) -> tuple[StageRun, StageRun]:
    """Run both stages on ``link`` (in the job's stage order); returns (upstream, downstream).

    ``receive_ahead``: the runners' receive-ahead depth (None: the default; 0: the serial path).
    """
    stages = range(len(job.spec.stages))
    runs = [stage_runner(job, i, data_dir, link, settings, receive_ahead=receive_ahead) for i in stages]
    for run in runs:
        run.runner.start()
    if during is not None:
        during(runs[0], runs[1], link)
    for run in runs:
        finish(run, timeout)
    return runs[0], runs[1]


def finish(run: StageRun, timeout: float = 240.0) -> None:
    """Wait for ``run``'s stage to end (any terminal state)."""
    run.runner.join(timeout)
    assert run.runner.board.finished, (
        f"stage {run.final.stage} did not finish in {timeout:.0f}s; threads:\n{thread_stacks()}"
    )


def thread_stacks() -> str:
    """Every thread's stack, for a wait that timed out: where a stage hung is the failure's only clue."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return "\n".join(
        f"--- {names.get(ident, ident)}\n{''.join(traceback.format_stack(frame))}"
        for ident, frame in sys._current_frames().items()
    )


def wait_for_step(run: StageRun, steps_done: int, timeout: float = 60.0) -> None:
    wait_for(
        lambda: run.runner.board.latest().steps_done >= steps_done or run.runner.board.finished,
        timeout,
        f"stage {run.final.stage} to finish step {steps_done}",
    )


def audit_records(pair: SwitchPair, event: str) -> list[dict[str, Any]]:
    """Every ``event`` record of cluster a's switch's audit log so far."""
    path = Path(pair.threads[0].running.audit.path)
    lines = path.read_text().splitlines() if path.is_file() else []
    return [record for line in lines if (record := json.loads(line))["event"] == event]


def audited(pair: SwitchPair, event: str, words: str) -> dict[str, Any]:
    """The first ``event`` record of cluster a's switch that mentions ``words`` (waited for, 10 s)."""
    return wait_for(
        lambda: next((r for r in audit_records(pair, event) if words in json.dumps(r)), None),
        10,
        f"a {event} record saying {words!r}",
    )


def train_split(
    switches: SwitchPair, carrier: str, work: Path, job_id: str, settings: EdgeSettings
) -> tuple[dict[int, float], list[torch.Tensor]]:
    """Both stages of a 6-step ``numbers`` job on ``carrier`` through the switches: the downstream's
    losses, then every parameter of both stages."""
    job = numbers_job(job_id, steps=6)
    runs = [stage_runner(job, index, work, switches, settings, carrier=carrier) for index in (0, 1)]
    for run in runs:
        run.runner.start()
    for run in runs:
        finish(run, 240)
        assert run.final.state == trainer_pb2.STAGE_STATE_SUCCEEDED, run.final.message
    losses = runs[1].losses()
    assert len(losses) == 6
    return losses, [p for run in runs for p in run.parameters()]
