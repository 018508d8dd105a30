"""Resolving a job's ``auto`` codecs before its stages start: each edge's link, then the advice.

An edge's link is the one its sending cluster's switch measures toward the receiving cluster
(``switch_link``), the stated one only when it cannot be measured; the micro-batch probe runs here
while the switches measure, and each edge is advised by its sending cluster's codec service.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from nebula_common.clients.endpoints import ClusterEndpoints
from nebula_common.errors import InvalidRequestError, NebulaError
from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.links import AUTO, LinkProfile

__all__ = ["LinkSource", "auto_links", "resolve_auto", "switch_link"]


class LinkSource(Protocol):
    """What ``auto`` needs of a cluster's session (``client.ClusterSession``): its endpoints, token, link."""

    endpoints: ClusterEndpoints

    @property
    def token(self) -> str: ...

    def link_status(self, peer_cluster: str = "", *, measure: bool = False) -> relay_pb2.LinkStatus: ...


def switch_link(source: LinkSource, peer: str, stated: LinkProfile | None) -> tuple[LinkProfile | None, str]:
    """The link from ``source``'s cluster toward ``peer`` as its switch measures it, else ``stated``.

    (link or None, why): a measured link says so in its ``source``; a stated one (the deployment's
    emulator settings, or ``links``/``link`` of ``submit_job``) carries why it was not measured.
    """
    here = source.endpoints.cluster_id
    try:
        status = source.link_status(peer, measure=True)
    except NebulaError as exc:
        why = f"switch {here} could not measure it: {exc}"
    else:
        if status.bandwidth_bps > 0:
            # The path's lowest recent RTT: the step model adds the queueing a job causes itself.
            rtt_ms = (status.min_rtt_seconds or status.rtt_seconds) * 1000.0
            lowest = " (the lowest of the last 5 minutes)" if status.min_rtt_seconds else ""
            measured = (
                f"measured by switch {here} toward {peer}: {status.bandwidth_bps / 1e6:.3g} Mbit/s, "
                f"RTT {rtt_ms:.1f} ms{lowest}"
            )
            return LinkProfile(status.bandwidth_bps / 1e6, rtt_ms, source=measured), measured
        why = f"switch {here} reports no bandwidth toward {peer} (a switch older than the measurement)"
    if stated is None:
        return None, why
    said = f"stated ({stated.bandwidth_mbit:g} Mbit/s, {stated.rtt_ms:g} ms RTT), not measured: {why}"
    return dataclasses.replace(stated, source=said), said


def resolve_auto(
    job: ProgramJob,
    sessions: Mapping[str, LinkSource],
    link: LinkProfile | None,
    links: dict[str, LinkProfile],
    measure: bool = True,
) -> None:
    """`auto` codecs: each edge advised by its sending cluster's codec service, for the link toward
    the receiving cluster as the sending switch measures it (``switch_link``; else the stated one)."""
    from nebula_common.codec.advice_client import advise_specs_sync
    from nebula_common.sdk.codec_advice import Advisor, resolve_auto_codecs, resolve_chain_codecs
    from nebula_common.sdk.job_probe import probe_micro_batch

    # The probe computes here while the switches measure their links: neither waits for the other.
    with ThreadPoolExecutor(1, thread_name_prefix="auto-probe") as pool:
        probing = pool.submit(probe_micro_batch, job)
        edge_links = auto_links(job, sessions, link, links, measure)
        probe = probing.result()
    edges = job.spec.edges
    sources = [sessions[job.spec.stages[index].cluster] for index in range(len(edges))]
    if len(edges) == 1 and edge_links[0] is not None:
        codec, token = sources[0].endpoints.codec, sources[0].token
        resolve_auto_codecs(job, codec, edge_links[0], token=token, probe=probe)
        return

    def advisor(source: LinkSource) -> Advisor:
        return lambda request: advise_specs_sync(source.endpoints.codec, request, token=source.token)

    fallback = LinkProfile(1.0, 0.0)  # never asked: an edge without auto keeps its configured codecs
    resolve_chain_codecs(
        job,
        [advisor(source) for source in sources],
        [lk or fallback for lk in edge_links],
        probe=probe,
    )


def auto_links(
    job: ProgramJob,
    sessions: Mapping[str, LinkSource],
    link: LinkProfile | None,
    links: dict[str, LinkProfile],
    measure: bool,
) -> list[LinkProfile | None]:
    """Each edge's link for ``auto``: measured by its sending switch, else stated (None: no auto)."""
    from nebula_common.codec.stream_options import canonical_spec

    edges = job.spec.edges
    sources = [sessions[job.spec.stages[index].cluster] for index in range(len(edges))]
    edge_links: list[LinkProfile | None] = []
    for index, (edge, source) in enumerate(zip(edges, sources, strict=True)):
        stated = links.get(edge.name, link)
        if not any(canonical_spec(c) == AUTO for c in (edge.codec.forward, edge.codec.backward)):
            edge_links.append(stated)
            continue
        if measure:
            found, why = switch_link(source, job.spec.stages[index + 1].cluster, stated)
        else:
            found, why = stated, "stated (measurement not asked)" if stated else "no link stated"
        if found is None or not source.endpoints.codec:
            raise InvalidRequestError(
                "codec 'auto' needs the link's bandwidth and RTT and the source cluster's codec service "
                f"address to ask for advice (edge {edge.name}, sending cluster "
                f"{source.endpoints.cluster_id}; link: {why})"
            )
        edge_links.append(found)
    return edge_links
