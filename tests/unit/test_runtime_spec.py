"""Job specs: a bad field is named (file and dotted path) before anything is sent; modules are checked."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nebula_common.errors import InvalidRequestError
from nebula_common.jobspec import SpecError, load_spec
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.sdk.jobs import ProgramJob
from services.trainer.validation import validate_stage_spec

pytestmark = pytest.mark.timeout(30)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digit_sum"


def write_job(tmp_path: Path, mutate: dict | None = None, drop: str | None = None) -> Path:
    data = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    for name in ("features.py", "labels.py"):
        (tmp_path / name).write_text((EXAMPLE / name).read_text())
    if drop:
        del data[drop]
    for key, value in (mutate or {}).items():
        node = data
        *path, last = key.split(".")
        for part in path:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(data))
    return spec


def test_the_shipped_example_and_builtin_job_load() -> None:
    for path in (EXAMPLE / "job.yaml", builtin_spec("numbers")):
        loaded = load_spec(path)
        assert [s.name for s in loaded.spec.stages] == list(loaded.modules)


@pytest.mark.parametrize(
    ("mutate", "named"),
    [
        ({"steps": 0}, "steps: Input should be greater than or equal to 1"),
        ({"data.micro_batches": 5}, "data: batch_size 64 must be a multiple of micro_batches 5"),
        ({"pipeline.schedule": "zigzag"}, "pipeline.schedule"),
        ({"optimizer.name": "lamb"}, "optimizer.name"),
        ({"edges.0.codec.forward": "zip9"}, "edges.0.codec.forward"),
        ({"stages.1.cluster": "a"}, "each stage must run in a different cluster"),
        ({"edges.0.to": "nowhere"}, "must go from the first stage to the second"),
        ({"stages.0.module": "missing.py"}, "stages.0.module: no such file"),
        ({"surprise": 1}, "surprise: Extra inputs are not permitted"),
    ],
)
def test_bad_fields_are_named(tmp_path: Path, mutate: dict, named: str) -> None:
    spec = write_job(tmp_path, mutate)
    with pytest.raises(SpecError) as error:
        load_spec(spec)
    assert named in str(error.value) and str(spec) in str(error.value)


def test_a_missing_section_is_named(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="data: Field required"):
        load_spec(write_job(tmp_path, drop="data"))


def test_a_module_without_the_loss_function_is_refused(tmp_path: Path) -> None:
    spec = write_job(tmp_path)
    labels = tmp_path / "labels.py"
    labels.write_text(labels.read_text().replace("def loss(", "def not_the_loss("))
    with pytest.raises(SpecError, match=r"stages.1.module: .*labels.py must define loss"):
        load_spec(spec)


def test_a_module_with_a_syntax_error_is_refused_with_its_line(tmp_path: Path) -> None:
    spec = write_job(tmp_path)
    (tmp_path / "features.py").write_text("def build(options:\n")
    with pytest.raises(SpecError, match=r"features.py:1: syntax error"):
        load_spec(spec)


def test_invalid_yaml_is_refused(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(spec)


def test_each_cluster_receives_only_its_own_stage() -> None:
    job = ProgramJob(load_spec(EXAMPLE / "job.yaml"))
    reader, head = job.stage_spec("reader"), job.stage_spec("head")
    assert reader.program.role == "upstream" and head.program.role == "downstream"
    assert "class Reader" in reader.program.module_source
    assert "class Reader" not in head.program.module_source
    assert "def loss" not in reader.program.module_source
    assert (reader.codec_forward, reader.codec_backward) == ("fp16", "int8")
    assert reader.program.micro_batches == head.program.micro_batches == 4
    assert job.clusters() == {"reader": "a", "head": "b"}


def test_overrides_are_validated_like_the_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"data\.micro_batches"):
        load_spec(EXAMPLE / "job.yaml", {"data.micro_batches": 0})
    assert load_spec(EXAMPLE / "job.yaml", {"steps": 3}).spec.steps == 3


ELECTRA = builtin_spec("electra")


def test_the_electra_job_splits_into_one_way_stage_specs_with_replicas() -> None:
    job = ProgramJob(load_spec(ELECTRA))
    generator, discriminator = job.stage_spec("generator"), job.stage_spec("discriminator")
    assert (generator.program.mode, generator.program.payload, generator.program.replicas) == (
        "one_way",
        "int64",
        1,
    )
    assert discriminator.program.replicas == 2 and discriminator.program.sync_lag == 1
    assert (
        "def produce" in generator.program.module_source
        and "def produce" not in discriminator.program.module_source
    )


@pytest.mark.parametrize(
    ("overrides", "field", "reason"),
    [
        ({"edges.0.codec.backward": "int8"}, "edges.0.codec.backward", "sync tensor"),
        ({"edges.0.codec.forward": "fp16"}, "edges.0.codec.forward", "int64 payload"),
        ({"pipeline.mode": "backprop"}, "edges.0.payload", "one_way"),
        ({"stages.0.replicas": 2}, "stages.0.replicas", "one_way upstream"),
        ({"stages.1.replicas": 3}, "stages.1.replicas", "does not divide"),
        ({"stages.1.replicas": 0}, "stages.1.replicas", "greater than or equal to 1"),
        ({"pipeline.sync_lag": -1}, "pipeline.sync_lag", "greater than or equal to 0"),
    ],
)
def test_bad_one_way_and_replica_settings_name_the_field(overrides: dict, field: str, reason: str) -> None:
    with pytest.raises(SpecError) as error:
        load_spec(ELECTRA, overrides)
    assert field in str(error.value) and reason in str(error.value)


def test_a_one_way_upstream_module_must_define_produce(tmp_path: Path) -> None:
    for name in ("job.yaml", "generator.py", "discriminator.py"):
        text = (ELECTRA.parent / name).read_text()
        (tmp_path / name).write_text(
            text.replace("def produce(", "def make(") if name == "generator.py" else text
        )
    with pytest.raises(SpecError, match=r"stages\.0\.module: .* must define produce"):
        load_spec(tmp_path / "job.yaml")


def test_a_backprop_upstream_stage_may_run_on_several_replicas() -> None:
    """The spec and the trainer's own check of the stage spec accept it; the row split is still checked."""
    job = ProgramJob(load_spec(EXAMPLE / "job.yaml", {"stages.0.replicas": 2}))
    reader = job.stage_spec("reader")
    assert (reader.program.role, reader.program.replicas) == ("upstream", 2)
    validate_stage_spec(reader)  # raises on any problem
    with pytest.raises(SpecError, match=r"stages\.0\.replicas: .* 3 does not divide it"):
        load_spec(EXAMPLE / "job.yaml", {"stages.0.replicas": 3})


@pytest.mark.parametrize(
    ("overrides", "field", "reason"),
    [
        ({"stages.1.parallel": "zero3"}, "stages.1.parallel", "'ddp', 'fsdp' or 'hsdp'"),
        ({"stages.1.parallel": "fsdp"}, "stages.1.parallel", "needs replicas >= 2, got 1"),
        ({"stages.1.parallel": "hsdp", "stages.1.replicas": 4}, "stages.1.shard_size", "needs the ranks"),
        (
            {"stages.1.parallel": "hsdp", "stages.1.replicas": 4, "stages.1.shard_size": 4},
            "stages.1.shard_size",
            "must divide replicas 4 and be below it",
        ),
        ({"stages.1.replicas": 2, "stages.1.shard_size": 2}, "stages.1.shard_size", "only an hsdp stage"),
        (
            {"stages.1.parallel": "fsdp", "stages.1.replicas": 2, "stages.1.shard_size": 2},
            "stages.1.shard_size",
            "use hsdp",
        ),
    ],
)
def test_bad_sharding_settings_name_the_field(overrides: dict, field: str, reason: str) -> None:
    with pytest.raises(SpecError) as error:
        load_spec(EXAMPLE / "job.yaml", {"data.batch_size": 32, **overrides})
    assert field in str(error.value) and reason in str(error.value), str(error.value)


def test_sharded_stages_reach_the_trainer_and_its_check_names_bad_values() -> None:
    job = ProgramJob(
        load_spec(
            EXAMPLE / "job.yaml",
            {
                "data.batch_size": 32,
                "stages.1.replicas": 4,
                "stages.1.parallel": "hsdp",
                "stages.1.shard_size": 2,
            },
        )
    )
    stage = job.stage_spec(job.spec.stages[1].name)
    assert (stage.program.parallel, stage.program.replicas, stage.program.shard_size) == ("hsdp", 4, 2)
    validate_stage_spec(stage)
    stage.program.shard_size = 3
    with pytest.raises(InvalidRequestError, match=r"program\.shard_size: 3 must divide replicas 4"):
        validate_stage_spec(stage)
    stage.program.parallel = "zero3"
    with pytest.raises(
        InvalidRequestError, match=r"program\.parallel 'zero3' must be one of ddp, fsdp, hsdp"
    ):
        validate_stage_spec(stage)
    stage.program.parallel = "fsdp"
    stage.program.shard_size = 0
    stage.program.initial_state = b"x"
    with pytest.raises(InvalidRequestError, match=r"hot start into a sharded"):
        validate_stage_spec(stage)
