"""The relay servicer split into one module per concern still answers to its old module.

``services.switch.relay_servicer`` was one module; its parts (``relay_*.py``) now hold the edge pump,
the refusals, the penalties, the drain at stop, GetLinkStatus and RenewEdges. Callers that imported a
name from the servicer's module keep getting the part's own object, not a copy that could drift.
"""

from __future__ import annotations


def test_the_relay_servicer_module_still_exports_what_moved_to_its_parts() -> None:
    from services.switch import relay_drain, relay_edge_pump, relay_servicer

    for module in (relay_drain, relay_edge_pump):
        for name in relay_servicer.__all__:
            if hasattr(module, name):
                assert getattr(relay_servicer, name) is getattr(module, name), name
    assert set(relay_servicer.__all__) <= set(dir(relay_servicer))


def test_the_servicer_serves_every_relay_method_from_its_parts() -> None:
    from services.switch.relay_servicer import RelayServicer

    for method in ("OpenEdge", "GetLinkStatus", "RenewEdges", "serve_edge", "drain_edges", "stopping"):
        assert callable(getattr(RelayServicer, method, None)), method
