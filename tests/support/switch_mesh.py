"""Three clusters in a chain, a - b - c: real auth servers and switches, b linked to both a and c.

Switch b is the middle of the chain: it has two peers (``peers="a,c"``, both dial it) and one WAN
port; a and c are ordinary single-peer switches (``peer_cluster_id="b"``), so the test exercises both
settings forms. Every link is mutual TLS with the certificates of one ``init_pki(..., ["a", "b", "c"])``.
Edges name the cluster at their other end (``EdgeOpen.peer_cluster``), as chain trainers do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nebula_common.pki import PkiLayout
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.wan.emulator import LinkShape, WanEmulator
from services.switch.config import SwitchSettings
from services.trainer.edge import EdgeConnection, EdgeSettings, GrpcEdgeTransport
from tests.support.accounts import ADMIN_PASSWORD, auth_settings
from tests.support.edges import edge_end, open_pair, wait_for
from tests.support.servers import AuthServerThread, SwitchThread, running_auth

CHAIN = ("a", "b", "c")


@dataclass
class Chain:
    """The three clusters' auth servers, switches and admin tokens."""

    auths: dict[str, AuthServerThread]
    switches: dict[str, SwitchThread]
    tokens: dict[str, str]
    stopped: set[str]

    def stop(self, cluster: str) -> None:
        """Stop one cluster's switch now (its links go down as a cut link's would)."""
        if cluster not in self.stopped:
            self.stopped.add(cluster)
            self.switches[cluster].stop()

    def edge_pair(
        self,
        job_id: str,
        edge: str,
        ends: tuple[str, str],
        settings: EdgeSettings,
        codec_forward: str = "none",
        codec_backward: str = "none",
    ) -> tuple[EdgeConnection, EdgeConnection]:
        """Both ends of ``edge``: upstream in cluster ``ends[0]``, downstream in ``ends[1]``."""

        def open_end(index: int) -> EdgeConnection:
            here, there = ends[index], ends[1 - index]
            transport = GrpcEdgeTransport(
                self.switches[here].internal_address, self.tokens[here], job_id, edge, peer_cluster=there
            )
            return edge_end(transport, job_id, edge, index, settings, codec_forward, codec_backward)

        return open_pair(open_end)


def chain_settings(work: Path, pki: PkiLayout, cluster: str, auth: str, **fields: Any) -> SwitchSettings:
    paths = pki.cluster(cluster)
    return SwitchSettings(
        **{
            "cluster_id": cluster,
            "tls_cert": paths.switch_cert,
            "tls_key": paths.switch_key,
            "trust_bundle": paths.trust_bundle,
            "own_crl": paths.crl,
            "auth_address": auth,
            "data_dir": work / cluster / "switch",
            "metrics_port": -1,
            **fields,
        }
    )


@contextmanager
def switch_chain(
    work: Path, pki: PkiLayout, shapes: dict[str, LinkShape] | None = None, **middle: Any
) -> Iterator[Chain]:
    """a - b - c with both links up; ``middle`` overrides settings of switch b.

    ``shapes``: per outer cluster ("a", "c"), a WAN emulator (``WanEmulator``, on switch b's event
    loop) between that cluster's switch and b's WAN port, shaping its link as given.
    """
    with ExitStack() as stack:
        auths = {}
        stopped: set[str] = set()

        def stop(cluster: str) -> None:
            if cluster not in stopped:
                stopped.add(cluster)
                switches[cluster].stop()

        for cluster in CHAIN:
            (work / cluster).mkdir(parents=True, exist_ok=True)
            auths[cluster] = stack.enter_context(running_auth(auth_settings(work / cluster, cluster)))
        b = SwitchThread(chain_settings(work, pki, "b", auths["b"].address, peers="a,c", **middle))
        switches = {"b": b}
        stack.callback(stop, "b")
        wan = f"127.0.0.1:{b.running.wan_port}"
        for cluster in ("a", "c"):
            address = wan
            if shapes and cluster in shapes:
                emulator = WanEmulator("127.0.0.1", b.running.wan_port, shapes[cluster])
                port = asyncio.run_coroutine_threadsafe(emulator.start(), b._loop).result(10)
                stack.callback(
                    lambda e=emulator: asyncio.run_coroutine_threadsafe(e.stop(), b._loop).result(10)
                )
                address = f"127.0.0.1:{port}"
            switch = SwitchThread(
                chain_settings(
                    work,
                    pki,
                    cluster,
                    auths[cluster].address,
                    peer_cluster_id="b",
                    peer_address=address,
                    link_role="dial",
                )
            )
            switches[cluster] = switch
            stack.callback(stop, cluster)
        for peer in ("a", "c"):
            link = b.running.links.get(peer)
            assert link is not None
            wait_for(lambda link=link: link.connected, 30, f"the b-{peer} link")  # type: ignore[misc]
        tokens = {}
        for cluster in CHAIN:
            with AuthClient(auths[cluster].address) as client:
                tokens[cluster] = client.login("admin", ADMIN_PASSWORD).token
        yield Chain(auths, switches, tokens, stopped)
