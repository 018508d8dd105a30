"""``nebula local up``'s audit signer layout: keys in the signer's directory, old keys moved there first.

A run directory from before the signer keeps each service's seal key beside its log
(``<run>/<cluster>/<service>/audit-key.pem``); ``signer_layout`` moves it to the signer's directory
before anything starts, so the service (which refuses to start while it can read a key) starts and its
old seals still verify. A key in both places stops the start, naming both, and moves nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nebula_common.audit.signing import PRIVATE_KEY_NAME, AuditSigner
from nebula_common.errors import NebulaError
from nebula_common.launcher.signer import SIGNED, signer_layout


def _old_key(directory: Path) -> bytes:
    directory.mkdir(parents=True, exist_ok=True)
    AuditSigner.load_or_create(directory)
    return (directory / PRIVATE_KEY_NAME).read_bytes()


def test_an_old_run_directorys_keys_move_to_the_signer_and_sockets_sit_in_private_directories(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    old = {service: _old_key(run / "a" / service) for service in ("auth", "switch")}
    layout = signer_layout(run, "a")
    for service, key in old.items():
        assert not (run / "a" / service / PRIVATE_KEY_NAME).exists(), f"{service} can still read its key"
        assert (layout.keys / service / PRIVATE_KEY_NAME).read_bytes() == key
    for service in SIGNED:
        directory = layout.sockets[service].parent
        # The socket's folder may be searched (a boxed trainer's user reaches its socket through it);
        # the service's own folder above decides who gets that far.
        assert directory == run / "a" / service / "signer" and directory.stat().st_mode & 0o777 == 0o711
        assert directory.parent.stat().st_mode & 0o777 == 0o700, service
        assert layout.target(service) == f"unix:{layout.sockets[service]}"
    assert layout.keys.stat().st_mode & 0o777 == 0o700
    assert signer_layout(run, "a").keys == layout.keys  # a second start: nothing left to move


def test_a_key_in_both_places_stops_the_start_naming_both(tmp_path: Path) -> None:
    run = tmp_path / "run"
    service_key = _old_key(run / "a" / "data")
    signer_key = _old_key(run / "a" / "signer" / "data")
    with pytest.raises(NebulaError, match="are both audit keys of data in cluster a") as caught:
        signer_layout(run, "a")
    assert str(run / "a" / "data" / PRIVATE_KEY_NAME) in str(caught.value)
    assert (run / "a" / "data" / PRIVATE_KEY_NAME).read_bytes() == service_key
    assert (run / "a" / "signer" / "data" / PRIVATE_KEY_NAME).read_bytes() == signer_key
