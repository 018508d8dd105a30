"""Channels to a `nebula local up` deployment's internal ports, as a user or as one of its services.

Every internal port serves TLS (``nebula_common/rpc/internal_tls.py``): the client port needs no
client certificate (users: their token is the credential), the service port requires one of the
cluster's service identities, whose role ``nebula_common/auth/roles.py`` checks per method.
"""

from __future__ import annotations

from typing import cast

import grpc

from nebula_common.launcher.local import LocalDeployment
from nebula_common.pki.service_identity import ServiceTlsFiles, service_tls_dir
from nebula_common.rpc.internal_tls import ClientTls, internal_channel


def user_channel(address: str, service: str) -> grpc.Channel:
    """A user's channel to ``service``'s client port at ``address`` (TLS, no client certificate)."""
    return cast(grpc.Channel, internal_channel(address, service=service))


def service_address(deployment: LocalDeployment, cluster: str, target: str) -> str:
    return f"127.0.0.1:{deployment.process(f'{target}-{cluster}').info['service_port']}"


def service_channel(deployment: LocalDeployment, cluster: str, target: str, *, as_role: str) -> grpc.Channel:
    """A channel to ``target``'s service port presenting the identity of ``as_role`` (mutual TLS)."""
    files = ServiceTlsFiles.in_dir(service_tls_dir(deployment.pki_dir, cluster, as_role))
    tls = ClientTls.for_service(files, cluster)
    return cast(
        grpc.Channel, internal_channel(service_address(deployment, cluster, target), service=target, tls=tls)
    )
