"""One real two-cluster deployment (separate processes, emulated WAN) shared by the integration tests.

Package-scoped: it stops once the last integration test is done, not at the end of the session, so
its eleven idle processes (about 2 CPU-s a minute between them) do not run beside the unit tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nebula_common.launcher import LocalDeployment
from nebula_common.sdk.client import ClusterSession
from tests.support.accounts import make_user


@pytest.fixture(scope="package")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder the deployment's trainers read besides their own (``nebula local up --share``):
    pre-trained weights a test names by absolute path go here. Readable by a root launcher's trainer user."""
    folder = tmp_path_factory.mktemp("nebula-shared")
    folder.chmod(0o755)
    return folder


@pytest.fixture(scope="package")
def deployment(tmp_path_factory: pytest.TempPathFactory, shared_dir: Path) -> Iterator[LocalDeployment]:
    run_dir: Path = tmp_path_factory.mktemp("nebula-run")
    with pytest.MonkeyPatch.context() as env:
        # Repeated WAN refusals reach the audit log as counted records every 2 s, not every minute
        # (test_security_wan waits for them); the launched switches inherit this environment.
        env.setenv("NEBULA_SWITCH_REFUSAL_AUDIT_INTERVAL_S", "2")
        with LocalDeployment(
            run_dir=run_dir, bandwidth_mbit=100.0, delay_ms=5.0, shares=(shared_dir,)
        ) as running:
            yield running


@pytest.fixture(scope="package")
def new_user(deployment: LocalDeployment) -> Callable[[str, str], ClusterSession]:
    """Factory fixture: ``new_user(cluster, username) -> ClusterSession`` for a fresh account."""
    return lambda cluster, username: make_user(deployment, cluster, username)


@pytest.fixture(scope="package")
def sessions(deployment: LocalDeployment) -> dict[str, ClusterSession]:
    return {"a": make_user(deployment, "a", "alice"), "b": make_user(deployment, "b", "bob")}
