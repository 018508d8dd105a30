"""Imports respect the layers (library -> services -> user-facing) and form no circle.

The first test checks the real repository with tools/check_layers.py; the others build small
source trees to prove the checker sees what a careless import would hide (an import inside a
function, a relative import, ``from pkg import submodule``, a type-only import), so the first
test cannot pass merely because the checker went blind.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


def load_checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_layers", ROOT / "tools" / "check_layers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_layers"] = module
    spec.loader.exec_module(module)
    return module


checker = load_checker()


def make_tree(root: Path, files: dict[str, str]) -> Path:
    """Write ``files`` (relative path -> source) under ``root``, with every package's __init__."""
    for package in ("nebula_common", "services"):
        (root / package).mkdir(exist_ok=True)
        (root / package / "__init__.py").touch()
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            if str(parent) != ".":
                (root / parent / "__init__.py").touch()
        path.write_text(textwrap.dedent(source))
    return root


def messages(root: Path) -> list[str]:
    return [str(v) for v in checker.check(root)]


def test_the_repository_respects_the_layers() -> None:
    violations = checker.check(ROOT)
    assert not violations, "layering violations:\n" + "\n".join(str(v) for v in violations)


def test_a_deferred_import_of_the_sdk_from_the_library_is_caught(tmp_path: Path) -> None:
    root = make_tree(
        tmp_path,
        {
            "nebula_common/sdk/client.py": "X = 1\n",
            "nebula_common/data/batches.py": """
                def load():
                    from nebula_common.sdk.client import X
                    return X
            """,
        },
    )
    assert messages(root) == [
        "layer: nebula_common.data.batches imports nebula_common.sdk.client "
        "(nebula_common/data/batches.py:3): the shared library must not import user-facing code"
    ]


def test_library_importing_services_and_services_importing_user_code_are_caught(tmp_path: Path) -> None:
    root = make_tree(
        tmp_path,
        {
            "services/trainer/runner.py": "from nebula_common import cli\n",
            "nebula_common/cli/app.py": "",
            "nebula_common/launcher/local.py": "",
            "services/auth/store.py": """
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    import nebula_common.launcher.local
            """,
            "nebula_common/codec/bench.py": "import services.trainer.runner as runner\n",
        },
    )
    found = messages(root)
    assert len(found) == 3, found
    assert any("nebula_common.codec.bench imports services.trainer.runner" in m for m in found)
    assert any("services.trainer.runner imports nebula_common.cli (" in m for m in found)
    assert any("services.auth.store imports nebula_common.launcher.local" in m for m in found)


def test_imports_that_point_down_are_allowed(tmp_path: Path) -> None:
    root = make_tree(
        tmp_path,
        {
            "nebula_common/errors.py": "",
            "nebula_common/clients/data.py": "from nebula_common.errors import *\n",
            "services/data/server.py": "from nebula_common.clients import data\n",
            "nebula_common/sdk/data_client.py": "from nebula_common.clients.data import *\n",
            "nebula_common/cli/data.py": "import services.data.server\nfrom ..sdk import data_client\n",
        },
    )
    assert messages(root) == []


def test_an_import_circle_is_reported_by_module_names(tmp_path: Path) -> None:
    root = make_tree(
        tmp_path,
        {
            "services/trainer/runtime/stage.py": "from . import parallel\n",
            "services/trainer/runtime/parallel.py": """
                def build():
                    from .stage import Stage
            """,
            "nebula_common/pki/store.py": "from nebula_common.audit import log\n",
            "nebula_common/audit/log.py": "from nebula_common.durable import atomic_write\n",
            "nebula_common/durable.py": "import nebula_common.audit.signing\n",
            "nebula_common/audit/signing.py": "from nebula_common.pki.store import x\n",
        },
    )
    assert messages(root) == [
        "cycle: nebula_common.audit.log -> nebula_common.durable -> nebula_common.audit.signing"
        " -> nebula_common.pki.store -> nebula_common.audit.log",
        "cycle: services.trainer.runtime.parallel -> services.trainer.runtime.stage"
        " -> services.trainer.runtime.parallel",
    ]


def test_main_prints_every_violation_and_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_tree(
        tmp_path,
        {"nebula_common/sdk/jobs.py": "", "nebula_common/a.py": "import nebula_common.sdk.jobs\n"},
    )
    assert checker.main([str(root)]) == 1
    out = capsys.readouterr().out
    assert "nebula_common.a imports nebula_common.sdk.jobs (nebula_common/a.py:1)" in out
    (root / "nebula_common" / "a.py").write_text("")
    assert checker.main([str(root)]) == 0


def test_the_top_package_may_import_anything_and_nothing_imports_it(tmp_path: Path) -> None:
    root = make_tree(
        tmp_path,
        {
            "nebula/__init__.py": "from nebula_common.sdk.api import Deployment\n",
            "nebula_common/sdk/api.py": "from nebula_common.errors import *\n",
            "nebula_common/errors.py": "",
            "nebula_common/cli/job.py": "from nebula import Deployment\n",
            "services/trainer/server.py": "import nebula\n",
        },
    )
    found = messages(root)
    assert len(found) == 2, found
    assert all("nothing below it may import the top package 'nebula'" in m for m in found)
    assert any("nebula_common.cli.job imports nebula (" in m for m in found)
