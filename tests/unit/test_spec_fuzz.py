"""Malformed job specs: every one is refused up front with a message naming the file or field.

The set covers what users and tools actually produce: random bytes, the wrong text encoding, NaN and
infinity, numbers past every bound, wrong types, unknown and missing keys, YAML alias bombs and
cycles, missing or unreadable stage modules. Each case is checked twice: through the library
(``load_spec`` raises ``SpecError`` and nothing else) and through ``nebula job submit`` in-process
(exit status 2, the message printed, no traceback).
"""

from __future__ import annotations

import datetime
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from nebula_common.cli.app import app
from nebula_common.jobspec import SpecError, load_spec

pytestmark = pytest.mark.timeout(60)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digit_sum"
RAW = (EXAMPLE / "job.yaml").read_text()  # as the user wrote it (flow-style stages)
BASE: dict[str, Any] = yaml.safe_load(RAW)
MODULES = {name: (EXAMPLE / name).read_bytes() for name in ("features.py", "labels.py")}


def with_fields(**dotted: Any) -> bytes:
    """The example spec as YAML with fields changed (``data__batch_size=...``; ``...=DROP`` removes it)."""
    data = yaml.safe_load(yaml.safe_dump(BASE))
    for key, value in dotted.items():
        *path, last = key.split("__")
        node = data
        for part in path:
            node = node[int(part)] if isinstance(node, list) else node[part]
        index: Any = int(last) if isinstance(node, list) else last
        if value is DROP:
            del node[index]
        else:
            node[index] = value
    return yaml.safe_dump(data, allow_unicode=True).encode()


DROP = object()
GOOD = with_fields()
GOOD_TEXT = GOOD.decode()


def random_bytes(seed: int, size: int = 600) -> bytes:
    return random.Random(seed).randbytes(size)


def in_first_options(replacement: str) -> bytes:
    """The example spec with the first stage's ``options: {width: 64}`` replaced by YAML text."""
    assert "options: {width: 64}" in RAW
    return RAW.replace("options: {width: 64}", replacement, 1).encode()


def billion_laughs() -> bytes:
    lines = ["lol0: &l0 [lol]"]
    lines += [f"lol{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)]
    return in_first_options("options: {" + ", ".join(lines) + "}")


def module_case(name: str, content: bytes | None) -> dict[str, bytes | None]:
    """Files for a case whose spec is fine but whose first stage module is ``content`` (None: absent)."""
    return {"job.yaml": GOOD, "features.py": content}


@dataclass(frozen=True)
class Case:
    name: str
    files: dict[str, bytes | None]  # file name -> content; None = do not write it
    expected: str  # must appear in the message (names the field or what is wrong with the file)


def spec_case(name: str, content: bytes, expected: str) -> Case:
    return Case(name, {"job.yaml": content}, expected)


CASES: list[Case] = [
    # --- not text, or not UTF-8 text
    *(spec_case(f"random-bytes-{seed}", random_bytes(seed), "job.yaml: not UTF-8 text") for seed in range(5)),
    spec_case("random-bytes-short", b"\x80", "job.yaml: not UTF-8 text: byte 0x80 at offset 0"),
    spec_case("utf16-le-bom", GOOD_TEXT.encode("utf-16"), "job.yaml: the file is UTF-16 encoded"),
    spec_case("utf16-be-bom", b"\xfe\xff" + GOOD_TEXT.encode("utf-16-be"), "UTF-16 encoded"),
    spec_case("utf16-no-bom", GOOD_TEXT.encode("utf-16-le"), "job.yaml: not text: NUL byte"),
    spec_case("utf32", GOOD_TEXT.encode("utf-32"), "job.yaml: the file is UTF-32 encoded"),
    spec_case("latin1", GOOD_TEXT.replace("digit-sum", "café").encode("latin-1"), "byte 0xe9"),
    spec_case("cp1252-quotes", b"name: \x93quoted\x94\n", "not UTF-8 text: byte 0x93"),
    spec_case("nul-in-middle", GOOD[:40] + b"\x00" + GOOD[40:], "NUL byte at offset 40"),
    spec_case("control-char", b"name: a\x07b\n", "not valid YAML"),
    spec_case("gzip-header", b"\x1f\x8b\x08\x00" + random_bytes(9, 64), "not UTF-8 text"),
    # --- not one YAML mapping
    spec_case("empty", b"", "job.yaml: the spec is empty"),
    spec_case("comments-only", b"# nothing here\n\n", "the spec is empty"),
    spec_case("top-level-list", b"- a\n- b\n", "must be a mapping at the top level, got list"),
    spec_case("top-level-scalar", b"hello\n", "must be a mapping at the top level, got str"),
    spec_case("unclosed-flow", b"name: x\ndata: {batch_size: 4\n", "not valid YAML"),
    spec_case("tab-indent", b"data:\n\tbatch_size: 4\n", "not valid YAML"),
    spec_case("two-documents", GOOD + b"---\n" + GOOD, "not valid YAML"),
    spec_case("duplicate-key", GOOD + b"steps: 5\n", "duplicate key 'steps'"),
    spec_case("undefined-alias", b"name: *nope\n", "not valid YAML"),
    spec_case("python-tag", b"name: !!python/object/apply:os.system [echo hi]\n", "not valid YAML"),
    spec_case("unknown-tag", b"name: !vault secret\n", "not valid YAML"),
    spec_case("unhashable-key", b"? [a, b]\n: 1\n", "a mapping key must be a plain value"),
    spec_case("too-large", b"# " + b"x" * (1 << 20) + b"\n" + GOOD, "larger than"),
    # --- YAML aliases: cycles and bombs
    spec_case("alias-cycle-list", GOOD + b"extra: &s [*s]\n", "a cycle"),
    spec_case(
        "alias-cycle-map",
        in_first_options("options: &o {width: 64, self: *o}"),
        "a cycle",
    ),
    spec_case("billion-laughs", billion_laughs(), "once aliases are expanded"),
    spec_case(
        "alias-flood",
        (GOOD_TEXT + "x: &a 1\ny: [" + ", ".join(["*a"] * 300) + "]\n").encode(),
        "more than 256 aliases",
    ),
    spec_case("deep-nesting", GOOD + b"deep: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested deeper"),
    # --- NaN, infinity, huge numbers
    spec_case("lr-nan", with_fields(optimizer__lr=float("nan")), "optimizer.lr: Input should be a finite"),
    spec_case("lr-inf", with_fields(optimizer__lr=float("inf")), "optimizer.lr: Input should be a finite"),
    spec_case("lr-minus-inf", with_fields(optimizer__lr=float("-inf")), "optimizer.lr: Input should be a"),
    spec_case(
        "weight-decay-nan", with_fields(optimizer__weight_decay=float("nan")), "optimizer.weight_decay"
    ),
    spec_case("steps-nan", with_fields(steps=float("nan")), "steps: "),
    spec_case("steps-inf-literal", GOOD.replace(b"steps: 40", b"steps: 1.0e+400"), "steps: "),
    spec_case("steps-huge", with_fields(steps=10**30), "steps: Input should be less than or equal"),
    spec_case("seed-huge", with_fields(seed=2**70), "seed: "),
    spec_case("batch-huge", with_fields(data__batch_size=10**100), "data.batch_size"),
    spec_case("examples-negative", with_fields(data__examples=-5), "data.examples"),
    spec_case("steps-fraction", with_fields(steps=3.5), "steps: Input should be a valid integer"),
    spec_case("in-flight-huge", with_fields(pipeline__max_in_flight=10**9), "pipeline.max_in_flight"),
    spec_case("option-nan", with_fields(stages__0__options={"width": float("nan")}), "stages.0.options"),
    spec_case("replicas-inf", with_fields(stages__1__replicas=float("inf")), "stages.1.replicas"),
    # --- wrong types
    spec_case("steps-word", with_fields(steps="many"), "steps: "),
    spec_case("steps-date", with_fields(steps=datetime.date(2024, 1, 1)), "steps: "),
    spec_case("stages-string", with_fields(stages="ab"), "stages: "),
    spec_case("stages-map", with_fields(stages={}), "stages: "),
    spec_case("data-list", with_fields(data=[1, 2]), "data: "),
    spec_case("edges-int", with_fields(edges=5), "edges: "),
    spec_case("codec-int", with_fields(edges__0__codec__forward=123), "edges.0.codec.forward"),
    spec_case("codec-garbage", with_fields(edges__0__codec__forward="fp16(" * 2000), "edges.0.codec.forward"),
    spec_case("name-null", with_fields(name=None), "name: "),
    spec_case("name-bad-chars", with_fields(name="bad name!"), "name: String should match pattern"),
    spec_case("options-string", with_fields(stages__0__options="x"), "stages.0.options"),
    spec_case("options-set", with_fields(stages__0__options={"a", "b"}), "stages.0.options"),
    spec_case("options-binary", with_fields(stages__0__options={"w": b"\x00\x01"}), "stages.0.options"),
    spec_case("replicas-word", with_fields(stages__0__replicas="two"), "stages.0.replicas"),
    spec_case("optimizer-string", with_fields(optimizer="adam"), "optimizer: "),
    # --- unknown and missing keys, wrong shape
    spec_case("unknown-top-key", with_fields(surprise=1), "surprise: Extra inputs are not permitted"),
    spec_case("unknown-nested-key", with_fields(data__size=3), "data.size: Extra inputs"),
    spec_case("missing-data", with_fields(data=DROP), "data: Field required"),
    spec_case("missing-stages", with_fields(stages=DROP), "stages: Field required"),
    spec_case("missing-name", with_fields(name=DROP), "name: Field required"),
    spec_case("typo-step", with_fields(steps=DROP, step=40), "step: Extra inputs are not permitted"),
    spec_case("one-stage", with_fields(stages=[BASE["stages"][0]]), "stages: "),
    spec_case("three-stages", with_fields(stages=[*BASE["stages"], BASE["stages"][0]]), "stages: "),
    spec_case("edge-unknown-stage", with_fields(edges__0__from="ghost"), "job.yaml: edges.0: must go from"),
    spec_case("module-empty-path", with_fields(stages__0__module=""), "stages.0.module"),
    # --- stage modules
    Case("module-missing", module_case("x", None), "stages.0.module: no such file"),
    Case("module-random-bytes", module_case("x", random_bytes(3)), "stages.0.module: "),
    Case("module-latin1", module_case("x", b"# caf\xe9\ndef build(o): pass\n"), "stages.0.module: "),
    Case("module-utf16", module_case("x", MODULES["features.py"].decode().encode("utf-16")), "UTF-16"),
    Case("module-nul", module_case("x", b"def build(o):\x00 pass\n"), "stages.0.module: "),
    Case("module-syntax", module_case("x", b"def build(:\n"), "stages.0.module: "),
    Case("module-too-nested", module_case("x", b"x = " + b"(" * 400 + b")" * 400 + b"\n"), "stages.0.module"),
    Case("module-missing-functions", module_case("x", b"def build(o):\n    pass\n"), "must define"),
]


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


def materialise(case: Case, folder: Path) -> Path:
    files: dict[str, bytes | None] = {"job.yaml": GOOD, **MODULES, **case.files}
    for name, content in files.items():
        if content is not None:
            (folder / name).write_bytes(content)
    return folder / "job.yaml"


def test_the_fuzz_set_is_large_and_the_base_spec_is_good(tmp_path: Path) -> None:
    assert len(CASES) >= 50
    assert len({case.name for case in CASES}) == len(CASES)
    path = materialise(Case("good", {}, ""), tmp_path)
    assert load_spec(path).spec.name == "digit-sum"
    (tmp_path / "bom.yaml").write_bytes(b"\xef\xbb\xbf" + GOOD)  # a UTF-8 BOM is still UTF-8
    assert load_spec(tmp_path / "bom.yaml").spec.steps == 40


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_library_refuses_with_a_message(case: Case, tmp_path: Path) -> None:
    path = materialise(case, tmp_path)
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    message = str(caught.value)
    assert case.expected in message, message
    assert message.startswith(str(path)), f"the message does not name the file: {message}"
    assert "Traceback" not in message


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_cli_refuses_with_exit_2_and_no_traceback(case: Case, tmp_path: Path, runner: CliRunner) -> None:
    path = materialise(case, tmp_path)
    result = runner.invoke(app, ["job", "submit", str(path), "--deployment", str(tmp_path / "none.json")])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "invalid job spec" in result.stderr, result.output
    assert " ".join(case.expected.split()) in " ".join(result.stderr.split()), result.stderr
    assert "Traceback" not in result.output


LOADERS: list[tuple[str, Callable[[Path], Any]]] = [
    ("path", lambda folder: folder / "job.yaml"),
    ("path-string", lambda folder: str(folder / "job.yaml")),
    ("text", lambda folder: GOOD_TEXT),
    ("one-line-text", lambda folder: yaml.safe_dump(BASE, default_flow_style=True, width=10**6)),
    ("dict", lambda folder: yaml.safe_load(GOOD_TEXT)),
]


@pytest.mark.parametrize(("kind", "source"), LOADERS, ids=[kind for kind, _ in LOADERS])
def test_load_spec_takes_a_path_text_or_dict(
    kind: str, source: Callable[[Path], Any], tmp_path: Path
) -> None:
    materialise(Case("good", {}, ""), tmp_path)
    loaded = load_spec(source(tmp_path), {"steps": 3}, base_dir=tmp_path)
    assert loaded.spec.steps == 3
    assert set(loaded.modules) == {"reader", "head"}
    assert (loaded.spec_path is not None) == kind.startswith("path")


def test_a_dict_source_is_not_modified(tmp_path: Path) -> None:
    materialise(Case("good", {}, ""), tmp_path)
    data = yaml.safe_load(GOOD_TEXT)
    load_spec(data, {"data.micro_batches": 2}, base_dir=tmp_path)
    assert data["data"]["micro_batches"] == 4


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("no-such-spec.yaml", "no-such-spec.yaml: cannot read: No such file or directory"),
        ("name: x\nsteps: .nan\n", "spec: steps: "),
        ({"name": "x", "optimizer": {"lr": float("nan")}}, "spec: optimizer.lr: Input should be a finite"),
        (b"name: x", "a spec is a Path, YAML text or a dict, not a bytes"),
    ],
)
def test_text_dict_and_missing_sources_are_refused_by_name(
    source: Any, expected: str, tmp_path: Path
) -> None:
    with pytest.raises(SpecError, match=None) as caught:
        load_spec(source, base_dir=tmp_path)
    assert expected in str(caught.value)


def test_an_override_past_the_end_of_a_list_is_named(tmp_path: Path) -> None:
    path = materialise(Case("good", {}, ""), tmp_path)
    with pytest.raises(SpecError, match=r"override edges\.3: index 3 past the end \(1 items\)"):
        load_spec(path, {"edges.3": {}})
    with pytest.raises(SpecError, match=r"override stages\.5\.module: no stages\.5"):
        load_spec(path, {"stages.5.module": "x.py"})


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("optimizer.lr=.nan", "optimizer.lr: Input should be a finite number"),
        ("steps=.inf", "steps: Input should be a finite number"),
        ("edges.3={}", "override edges.3: index 3 past the end"),
    ],
)
def test_cli_overrides_are_validated_like_the_file(
    override: str, expected: str, tmp_path: Path, runner: CliRunner
) -> None:
    path = materialise(Case("good", {}, ""), tmp_path)
    args = ["job", "submit", str(path), "--set", override, "--deployment", str(tmp_path / "none.json")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and expected in result.stderr, result.output


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("steps={", "--set steps: not valid YAML"),
        (
            "stages.0.options=&a [*a]",
            "--set stages.0.options: line 1: alias *a refers to a node that contains it",
        ),
        ("data={a: 1, a: 2}", "--set data: line 1: duplicate key 'a'"),
        ("steps=" + "[" * 200 + "]" * 200, "--set steps: line 1: nested deeper than 64 levels"),
        ("steps=\x07", "--set steps: not valid YAML"),
    ],
    ids=["unclosed", "alias-cycle", "duplicate-key", "too-deep", "control-char"],
)
def test_bad_yaml_in_a_set_value_names_the_option(
    override: str, expected: str, tmp_path: Path, runner: CliRunner
) -> None:
    path = materialise(Case("good", {}, ""), tmp_path)
    args = ["job", "submit", str(path), "--set", override, "--deployment", str(tmp_path / "none.json")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.stderr.startswith("invalid --set value\n"), result.stderr
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.output


CREDENTIAL_FILES: list[tuple[str, bytes, str]] = [
    ("random-bytes", random_bytes(7), "not UTF-8 text"),
    ("utf-16", "a: {username: u, password: p}\n".encode("utf-16"), "the file is UTF-16 encoded"),
    ("unclosed", b"a: {username: u, password: p\n", "not valid YAML"),
    ("alias-cycle", b"a: &x [*x]\n", "alias *x refers to a node that contains it"),
    (
        "duplicate-cluster",
        b"a: {username: u, password: p}\na: {username: v, password: q}\n",
        "duplicate key 'a'",
    ),
    ("a-list", b"- a\n- b\n", "expected a mapping cluster -> {username, password}"),
    ("no-password", b"a: {username: u}\n", "a: needs username and password"),
    ("missing", b"", "cannot read: No such file or directory"),
]


@pytest.mark.parametrize(
    ("content", "expected"),
    [(content, expected) for _, content, expected in CREDENTIAL_FILES],
    ids=[name for name, _, _ in CREDENTIAL_FILES],
)
def test_a_malformed_credentials_file_is_refused_by_name(
    content: bytes, expected: str, tmp_path: Path, runner: CliRunner
) -> None:
    path = materialise(Case("good", {}, ""), tmp_path)
    creds = tmp_path / "creds.yaml"
    if expected.startswith("cannot read:"):
        creds = tmp_path / "no-such-creds.yaml"
    else:
        creds.write_bytes(content)
    args = [
        "job",
        "submit",
        str(path),
        "--credentials",
        str(creds),
        "--deployment",
        str(tmp_path / "none.json"),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    stderr = " ".join(result.stderr.split())
    assert "invalid --credentials file" in stderr and str(creds) in stderr, result.stderr
    assert expected in stderr, result.stderr
    assert "Traceback" not in result.output
