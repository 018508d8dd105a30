"""The one setting that says where stages' edges go, on both ends: a Unix socket path or a TCP port.

A value of neither form is refused at start-up naming the setting; a TCP port needs internal TLS (its
records are sealed after mutual TLS 1.3), so a switch or trainer without it refuses to start, naming why.
"""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from nebula_common.rpc.edge_tls import TLS, UNIX, edge_address
from nebula_common.rpc.internal_tls import InternalTlsError
from nebula_common.service.identity import ServiceIdentity
from services.switch.edge_socket import EdgeSocket
from services.switch.edge_tickets import EdgeTickets
from services.trainer.config import TrainerSettings
from services.trainer.server import _check_edge_tls, describe_edges


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ("/var/lib/nebula/edges/switch.sock", UNIX),
        ("run/a/edges/switch.sock", UNIX),
        ("nebula-switch:7402", TLS),
        ("0.0.0.0:7402", TLS),
        ("[::1]:7402", TLS),
    ],
)
def test_a_path_or_a_host_and_port(value: str, kind: str) -> None:
    assert edge_address(value, "X") == (kind, value)


@pytest.mark.parametrize("value", ["switch.sock", "nebula-switch", "host:", ":7402", "host:port", "h:70000"])
def test_anything_else_is_refused_naming_the_setting(value: str) -> None:
    with pytest.raises(ValueError, match=r"NEBULA_X=.*neither a socket path .* nor host:port"):
        edge_address(value, "NEBULA_X")


def test_the_trainer_refuses_a_bad_value_at_start_up() -> None:
    with pytest.raises(ValidationError, match="NEBULA_TRAINER_SWITCH_EDGE_SOCKET='nebula-switch'"):
        TrainerSettings(
            cluster_id="a",
            switch_address="127.0.0.1:1",
            auth_address="127.0.0.1:2",
            switch_edge_socket="nebula-switch",
        )


def test_a_tcp_edge_socket_without_internal_tls_is_refused_on_both_ends() -> None:
    settings = TrainerSettings(
        cluster_id="a",
        switch_address="127.0.0.1:1",
        auth_address="127.0.0.1:2",
        switch_edge_socket="nebula-switch:7402",
    )
    with pytest.raises(InternalTlsError, match=r"NEBULA_TRAINER_SWITCH_EDGE_SOCKET='nebula-switch:7402'"):
        _check_edge_tls(settings, ServiceIdentity("trainer", "a", None, None))
    served = EdgeSocket(relay=object(), tickets=EdgeTickets())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"NEBULA_SWITCH_EDGE_SOCKET='127\.0\.0\.1:0' is a TCP port"):
        asyncio.run(served.start("127.0.0.1:0"))


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("", "gRPC through each stage's proxy"),
        ("/run/a/edges/switch.sock", "records on the switch's edge socket /run/a/edges/switch.sock"),
        ("nebula-switch:7402", "sealed records on the switch's edge port nebula-switch:7402 (mutual TLS"),
    ],
)
def test_the_trainer_announces_how_its_stages_carry_their_edges(value: str, said: str) -> None:
    assert describe_edges(value).startswith(said)
