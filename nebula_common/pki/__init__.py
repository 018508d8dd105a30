"""Dev PKI for Nebula's WAN link: per-cluster CAs, switch certificates, and gRPC mTLS credentials.

Re-exported here so callers depend on one import path while the implementation stays split by
concern (identity parsing, CA operations, disk layout, gRPC credentials).
"""

from nebula_common.pki.ca import create_ca, issue_certificate
from nebula_common.pki.identity import (
    Identity,
    identity_from_certificate,
    identity_from_pem,
    validate_cluster_id,
)
from nebula_common.pki.store import ClusterPaths, PkiError, PkiLayout, add_trust, init_pki, load_layout
from nebula_common.pki.tls import (
    channel_credentials,
    channel_credentials_from_files,
    channel_options,
    peer_certificate,
    peer_identity,
    server_credentials,
    server_credentials_from_files,
    server_options,
)

__all__ = [
    "ClusterPaths",
    "Identity",
    "PkiError",
    "PkiLayout",
    "add_trust",
    "channel_credentials",
    "channel_credentials_from_files",
    "channel_options",
    "create_ca",
    "identity_from_certificate",
    "identity_from_pem",
    "init_pki",
    "issue_certificate",
    "load_layout",
    "peer_certificate",
    "peer_identity",
    "server_credentials",
    "server_credentials_from_files",
    "server_options",
    "validate_cluster_id",
]
