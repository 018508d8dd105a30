"""`nebula codec list|inspect`: the same facts as text and as JSON, from the real codec registry."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from nebula_common.cli.app import app


def test_list_as_json_is_the_registry() -> None:
    from nebula_common.codec import available_codecs

    outcome = CliRunner().invoke(app, ["codec", "list", "--json"])
    assert outcome.exit_code == 0, outcome.output
    assert json.loads(outcome.output) == list(available_codecs())


def test_inspect_as_json_matches_the_text() -> None:
    args = ["codec", "inspect", "int8", "--shape", "64,12,128"]
    body = json.loads(CliRunner().invoke(app, [*args, "--json"]).output)
    assert (body["canonical"], body["raw_bytes"], body["encoded_bytes"]) == ("int8", 393216, 98308)
    assert body["ratio"] == 98308 / 393216 and body["variable_size"] is False
    text = " ".join(CliRunner().invoke(app, args).output.split())
    assert "exactly 98308 bytes" in text and "(393216 raw)" in text
    auto = json.loads(CliRunner().invoke(app, ["codec", "inspect", "auto", "--json"]).output)
    assert auto == {"canonical": "auto", "wire_codec": None, "resolved_at": "job start"}


def test_a_bad_spec_is_named_not_a_traceback() -> None:
    outcome = CliRunner().invoke(app, ["codec", "inspect", "int9", "--json"])
    assert outcome.exit_code == 2
    assert "int9" in outcome.output and "Traceback" not in outcome.output
