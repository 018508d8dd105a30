"""Run a whole multi-cluster Nebula deployment as local processes (demo, tests, development)."""

from nebula_common.launcher.local import LocalDeployment, LocalDeploymentError

__all__ = ["LocalDeployment", "LocalDeploymentError"]
