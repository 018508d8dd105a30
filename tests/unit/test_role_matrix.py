"""The role matrix of the internal ports, checked against every service the protos define.

Generated from the descriptors: a new RPC in any ``proto/nebula/v1/*.proto`` fails here until it
is entered in ``nebula_common/auth/roles.py`` with the roles that may call it.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from nebula_common.auth.roles import OPERATOR_ROLE, ROLE_MATRIX, refusal
from nebula_common.pki.identity import KNOWN_ROLES
from nebula_common.pki.service_identity import SERVICE_ROLES
from nebula_common.proto.nebula import v1 as proto_v1


def _defined_methods() -> set[str]:
    methods = set()
    for info in pkgutil.iter_modules(proto_v1.__path__):
        if not info.name.endswith("_pb2"):
            continue
        module = importlib.import_module(f"{proto_v1.__name__}.{info.name}")
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                methods.add(f"/{service.full_name}/{method.name}")
    return methods


def test_every_method_of_every_service_is_in_the_matrix() -> None:
    defined = _defined_methods()
    assert len(defined) > 30, defined  # all seven services were found
    assert sorted(defined - set(ROLE_MATRIX)) == [], "methods without an entry in auth/roles.py"
    assert sorted(set(ROLE_MATRIX) - defined) == [], "entries in auth/roles.py that no proto defines"


def test_roles_are_known_service_identities() -> None:
    for method, access in ROLE_MATRIX.items():
        assert access.roles <= set(SERVICE_ROLES), (method, access.roles)
        assert access.roles <= KNOWN_ROLES
        assert access.users or access.roles, f"{method}: nobody may call it"
        assert access.why, method


@pytest.mark.parametrize(
    ("method", "role", "allowed"),
    [
        ("/nebula.v1.Relay/OpenEdge", "trainer", True),
        ("/nebula.v1.Relay/OpenEdge", None, False),  # no certificate: service-only
        ("/nebula.v1.Relay/OpenEdge", "codec", False),
        ("/nebula.v1.Relay/OpenEdge", OPERATOR_ROLE, False),  # an operator is a user, not a trainer
        ("/nebula.v1.Relay/GetLinkStatus", None, True),  # the SDK's summary
        ("/nebula.v1.Auth/GetSigningKeys", "data", True),
        ("/nebula.v1.Auth/GetSigningKeys", None, False),
        ("/nebula.v1.Auth/Login", None, True),
        ("/nebula.v1.Auth/Login", OPERATOR_ROLE, True),  # a user's optional certificate
        ("/nebula.v1.Auth/Login", "trainer", False),
        ("/nebula.v1.Data/ReadBatch", "trainer", True),
        ("/nebula.v1.Data/ReadBatch", "switch", False),
        ("/nebula.v1.Trainer/AssignStage", "codec", False),
        ("/nebula.v1.Codec/Advise", "trainer", True),
        ("/grpc.health.v1.Health/Check", None, True),
        ("/grpc.health.v1.Health/Check", "codec", True),
        ("/nebula.v1.Unknown/Call", "trainer", False),  # default deny
    ],
)
def test_refusal(method: str, role: str | None, allowed: bool) -> None:
    reason = refusal(method, role)
    assert (reason is None) == allowed, reason
    if reason is not None:
        assert method in reason
