"""Fixtures shared by unit and integration tests (pytest injects them by name; never import this)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import hypothesis  # noqa: F401  (imported at collection: see below)
import pytest

from nebula_common.pki import PkiLayout, init_pki
from nebula_common.rpc.internal_tls import PLAINTEXT_ENV

if TYPE_CHECKING:
    from tests.support.edges import SwitchPair

# hypothesis is imported above, at collection: its pytest plugin imports it at the session's end
# otherwise, when pytest compiles it to an AST while daemon threads of the tests may still format
# tracebacks (Python 3.11's carets parse source too), and CPython 3.11 fails such concurrent parses
# with "SystemError: AST constructor recursion depth mismatch" (gh-106905), failing a green run.


@pytest.fixture(scope="module")
def pki_ab(tmp_path_factory: pytest.TempPathFactory) -> PkiLayout:
    """A fresh PKI of clusters a and b (a CA and a switch certificate each, mutual trust).

    Module-scoped: issuing it costs a few key generations, and a module that revokes or renews
    certificates cannot leak that into another module.
    """
    return init_pki(tmp_path_factory.mktemp("pki"), ["a", "b"])


@pytest.fixture(scope="module")
def switches(tmp_path_factory: pytest.TempPathFactory, pki_ab: PkiLayout) -> Iterator[SwitchPair]:
    """Two real switch services (clusters a and b, linked, each with its edge socket) with a token for
    each, per test module."""
    from tests.support.edges import switch_pair  # only the modules that use it pay for the import

    with switch_pair(tmp_path_factory.mktemp("switches"), pki_ab, edge_sockets=True) as pair:
        yield pair


@pytest.fixture(scope="module")
def tls_switches(tmp_path_factory: pytest.TempPathFactory, pki_ab: PkiLayout) -> Iterator[SwitchPair]:
    """Two real switch services with internal TLS on, each serving its edge socket on a TCP port (what
    Kubernetes runs), with a token and the trainer's identity for each, per test module."""
    from tests.support.edges import switch_pair

    with switch_pair(tmp_path_factory.mktemp("tls-switches"), pki_ab, edge_sockets="tcp") as pair:
        yield pair


# In-process test servers (tests/support/servers.py and the unit tests) run without internal TLS
# files: the development flag lets them (and their clients) use plaintext. Deployments the tests
# start with `nebula local up` are given their TLS directories and use TLS regardless.
os.environ.setdefault(PLAINTEXT_ENV, "1")
# `nebula login` contexts: never the developer's own (~/.config/nebula), one empty file per test run;
# subprocesses inherit it. Tests that log in point NEBULA_CONTEXTS at a file of their own.
os.environ["NEBULA_CONTEXTS"] = os.path.join(
    os.environ.get("TMPDIR", "/tmp"), f"nebula-test-contexts-{os.getpid()}.json"
)
