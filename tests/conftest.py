"""Fixtures shared by unit and integration tests (pytest injects them by name; never import this)."""

from __future__ import annotations

import pytest

from nebula_common.pki import PkiLayout, init_pki


@pytest.fixture(scope="module")
def pki_ab(tmp_path_factory: pytest.TempPathFactory) -> PkiLayout:
    """A fresh PKI of clusters a and b (a CA and a switch certificate each, mutual trust).

    Module-scoped: issuing it costs a few key generations, and a module that revokes or renews
    certificates cannot leak that into another module.
    """
    return init_pki(tmp_path_factory.mktemp("pki"), ["a", "b"])
