"""The committed gRPC stubs are exactly what tools/gen_proto.py generates from proto/."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "tools" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_proto"] = module
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    gen = load_generator()
    gen.generate(tmp_path)
    assert gen.stub_files(tmp_path) == gen.stub_files(gen.OUT_ROOT)


def test_a_proto_change_makes_the_stubs_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = load_generator()
    protos = tmp_path / "proto"
    (protos / "nebula" / "v1").mkdir(parents=True)
    for source in (gen.PROTO_ROOT / "nebula" / "v1").glob("*.proto"):
        (protos / "nebula" / "v1" / source.name).write_text(source.read_text())
    tensor = protos / "nebula" / "v1" / "tensor.proto"
    tensor.write_text(
        tensor.read_text().replace("uint64 frame_id = 12;", "uint64 frame_id = 12;\n  bool extra = 999;")
    )
    monkeypatch.setattr(gen, "PROTO_ROOT", protos)
    out = tmp_path / "out"
    out.mkdir()
    gen.generate(out)
    assert gen.stub_files(out) != gen.stub_files(gen.OUT_ROOT)


def test_stubs_import_cleanly_from_the_package() -> None:
    from nebula_common.proto.nebula.v1 import link_pb2_grpc, relay_pb2_grpc, trainer_pb2

    assert link_pb2_grpc.SwitchLinkStub and relay_pb2_grpc.RelayStub
    assert trainer_pb2.DESCRIPTOR.package == "nebula.v1"
