"""Codec service over a real gRPC channel: round trips, error mapping, health, metrics, entry point."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import selectors
import signal
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from nebula_common.codec import CodecError, available_codecs, decode_tensor, encode_tensor, to_frames
from nebula_common.codec.advice import job_advice_request
from nebula_common.codec.advice_client import AdviceUnavailableError, advise_specs, advise_specs_sync
from nebula_common.codec.advice_proto import request_to_proto, result_from_proto
from nebula_common.codec.wire import raw_to_tensor, tensor_to_raw
from nebula_common.metrics import listen_host
from nebula_common.proto.nebula.v1 import codec_pb2, codec_pb2_grpc
from nebula_common.rpc import ServiceServer, bearer_metadata
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.service.host import start_service
from services.auth.config import AuthSettings
from services.auth.server import SERVICE as AUTH_SERVICE
from services.codec.config import CodecSettings
from services.codec.server import SERVICE as CODEC_SERVICE
from tests.support.service_thread import ServiceThread

pytestmark = pytest.mark.timeout(60)

ADMIN_PASSWORD = "codec-test-admin-password"


@dataclass(frozen=True)
class AuthFixture:
    address: str
    token: str


@pytest.fixture(scope="module")
def auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthFixture]:
    """Cluster a's real auth service: the codec service checks every call's token with its keys."""
    work = tmp_path_factory.mktemp("codec-auth")
    (work / "admin-password").write_text(ADMIN_PASSWORD)
    running = ServiceThread(
        AUTH_SERVICE,
        AuthSettings(
            cluster_id="a",
            data_dir=work / "auth",
            admin_password_file=work / "admin-password",
            metrics_port=-1,
            argon2_time_cost=1,
            argon2_memory_cost_kib=1024,
        ),
    )
    try:
        with AuthClient(running.address) as client:
            yield AuthFixture(running.address, client.login("admin", ADMIN_PASSWORD).token)
    finally:
        running.stop()


class _WithToken:
    """A stub whose every call carries the bearer token (the service refuses calls without one)."""

    def __init__(self, stub: codec_pb2_grpc.CodecStub, token: str) -> None:
        self._stub = stub
        self._metadata = bearer_metadata(token)

    def __getattr__(self, method: str) -> Callable[..., object]:
        return functools.partial(getattr(self._stub, method), metadata=self._metadata)


_AUTH: list[AuthFixture] = []
"""The module's auth fixture, for ``_serve`` (set by the autouse fixture below)."""


@pytest.fixture(autouse=True)
def _codec_auth(auth: AuthFixture) -> Iterator[None]:
    _AUTH.append(auth)
    yield
    _AUTH.pop()


REPO_ROOT = Path(__file__).resolve().parents[2]

Check = Callable[[codec_pb2_grpc.CodecStub, grpc.aio.Channel, ServiceServer], Awaitable[None]]


def _serve(check: Check, metrics_port: int = -1, calibration_cache: str = "off") -> None:
    """Start the real server on an ephemeral port, run ``check`` against it, always stop it.

    Calibration runs on the first Advise only (tests that never ask for advice do
    not pay for it) and is not cached unless a test says where.
    """

    async def run() -> None:
        auth = _AUTH[-1]
        settings = CodecSettings(
            cluster_id="a",
            auth_address=auth.address,
            listen="127.0.0.1:0",
            metrics_port=metrics_port,
            calibration_cache=calibration_cache,
            calibrate_at_start=False,
        )
        running = await start_service(CODEC_SERVICE, settings)
        try:
            address = f"127.0.0.1:{running.ports['grpc_port']}"
            async with grpc.aio.insecure_channel(address) as channel:
                stub = _WithToken(codec_pb2_grpc.CodecStub(channel), auth.token)
                await check(stub, channel, running.handle)  # type: ignore[arg-type]
        finally:
            await running.stop()

    asyncio.run(run())


def _raw(tensor: torch.Tensor) -> codec_pb2.RawTensor:
    dtype, shape, data = tensor_to_raw(tensor)
    return codec_pb2.RawTensor(dtype=dtype, shape=shape, data=data)


async def _expect_invalid(call: Awaitable[object]) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return info.value.details() or ""


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _encode_requests(codec: str, outcome: str) -> float:
    return _sample("nebula_codec_requests_total", method="Encode", codec=codec, outcome=outcome)


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "int8"])
def test_encode_decode_round_trip(spec: str) -> None:
    tensor = torch.randn(3, 7, 5)

    async def check(stub: codec_pb2_grpc.CodecStub, _: grpc.aio.Channel, __: ServiceServer) -> None:
        encoded = await stub.Encode(codec_pb2.EncodeRequest(codec=spec.upper(), tensor=_raw(tensor)))
        reference = encode_tensor(tensor, spec)
        assert encoded.header == reference.header
        assert encoded.payload == reference.payload
        decoded = await stub.Decode(codec_pb2.DecodeRequest(header=encoded.header, payload=encoded.payload))
        assert (decoded.tensor.dtype, list(decoded.tensor.shape)) == ("float32", [3, 7, 5])
        result = raw_to_tensor(decoded.tensor.dtype, decoded.tensor.shape, decoded.tensor.data)
        tolerance = {"none": 0.0, "fp16": 1e-2, "bf16": 5e-2, "int8": 5e-2}[spec]
        assert float((result - tensor).abs().max()) <= tolerance

    _serve(check)


def test_bad_spec_is_invalid_argument_naming_the_codec() -> None:
    async def check(stub: codec_pb2_grpc.CodecStub, _: grpc.aio.Channel, __: ServiceServer) -> None:
        raw = _raw(torch.ones(4))
        details = await _expect_invalid(stub.Encode(codec_pb2.EncodeRequest(codec="zstd9", tensor=raw)))
        assert "zstd9" in details and "fp16" in details  # names the bad codec and lists known ones
        details = await _expect_invalid(stub.Encode(codec_pb2.EncodeRequest(codec="fp16(0.5)", tensor=raw)))
        assert "fp16's argument must be" in details
        details = await _expect_invalid(stub.Encode(codec_pb2.EncodeRequest(codec="ef(int8)", tensor=raw)))
        assert "configures a trainer stream" in details
        header = encode_tensor(torch.ones(4), "fp16").header
        header.codec = "zstd9"
        details = await _expect_invalid(stub.Decode(codec_pb2.DecodeRequest(header=header, payload=b"")))
        assert "codec" in details and "zstd9" in details

    _serve(check)


def test_bad_raw_tensor_and_corrupt_payload_are_invalid_argument() -> None:
    async def check(stub: codec_pb2_grpc.CodecStub, _: grpc.aio.Channel, __: ServiceServer) -> None:
        short = codec_pb2.RawTensor(dtype="float32", shape=[4], data=b"\x00" * 15)
        details = await _expect_invalid(stub.Encode(codec_pb2.EncodeRequest(codec="fp16", tensor=short)))
        assert "tensor.data" in details
        wrong_dtype = codec_pb2.RawTensor(dtype="int32", shape=[4], data=b"\x00" * 16)
        details = await _expect_invalid(
            stub.Encode(codec_pb2.EncodeRequest(codec="fp16", tensor=wrong_dtype))
        )
        assert "tensor.dtype" in details
        negative = codec_pb2.RawTensor(dtype="float32", shape=[-4], data=b"")
        details = await _expect_invalid(stub.Encode(codec_pb2.EncodeRequest(codec="fp16", tensor=negative)))
        assert "tensor.shape" in details
        nan = _raw(torch.tensor([1.0, float("nan")]))
        details = await _expect_invalid(stub.Encode(codec_pb2.EncodeRequest(codec="int8", tensor=nan)))
        assert "nan" in details
        encoded = encode_tensor(torch.randn(16), "int8")
        corrupt = encoded.payload[:-1] + bytes([encoded.payload[-1] ^ 1])
        details = await _expect_invalid(
            stub.Decode(codec_pb2.DecodeRequest(header=encoded.header, payload=corrupt))
        )
        assert "checksum" in details
        details = await _expect_invalid(stub.Decode(codec_pb2.DecodeRequest()))
        assert "dtype" in details

    _serve(check)


def test_list_codecs() -> None:
    async def check(stub: codec_pb2_grpc.CodecStub, _: grpc.aio.Channel, __: ServiceServer) -> None:
        response = await stub.ListCodecs(codec_pb2.ListCodecsRequest())
        assert list(response.codecs) == available_codecs()
        assert {"none", "fp16", "bf16", "int8"} <= set(response.codecs)

    _serve(check)


def test_health_reports_serving() -> None:
    async def check(_: codec_pb2_grpc.CodecStub, channel: grpc.aio.Channel, __: ServiceServer) -> None:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("nebula.v1.Codec", ""):
            response = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert response.status == health_pb2.HealthCheckResponse.SERVING

    _serve(check)


def test_metrics_are_counted_and_exported() -> None:
    async def check(stub: codec_pb2_grpc.CodecStub, _: grpc.aio.Channel, server: ServiceServer) -> None:
        ok_before = _encode_requests("int8", "ok")
        bad_before = _encode_requests("invalid", "invalid_argument")
        in_before = _sample("nebula_codec_bytes_in_total", method="Encode")
        out_before = _sample("nebula_codec_bytes_out_total", method="Encode")
        seconds_before = _sample("nebula_codec_seconds_count", method="Encode")

        await stub.Encode(codec_pb2.EncodeRequest(codec="int8", tensor=_raw(torch.ones(100))))
        await _expect_invalid(stub.Encode(codec_pb2.EncodeRequest(codec="nope", tensor=_raw(torch.ones(1)))))

        assert _encode_requests("int8", "ok") == ok_before + 1
        assert _encode_requests("invalid", "invalid_argument") == bad_before + 1
        assert _sample("nebula_codec_bytes_in_total", method="Encode") == in_before + 404
        assert _sample("nebula_codec_bytes_out_total", method="Encode") == out_before + 104
        assert _sample("nebula_codec_seconds_count", method="Encode") == seconds_before + 2

        url = f"http://127.0.0.1:{server.ports['metrics']}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        assert 'nebula_codec_requests_total{codec="int8",method="Encode",outcome="ok"}' in body

    _serve(check, metrics_port=0)


def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEBULA_CODEC_LISTEN", "[::]:7001")
    monkeypatch.setenv("NEBULA_CODEC_METRICS_PORT", "-1")
    monkeypatch.setenv("NEBULA_CODEC_LOG_LEVEL", "debug")
    monkeypatch.setenv("NEBULA_CODEC_CLUSTER_ID", "a")
    monkeypatch.setenv("NEBULA_CODEC_AUTH_ADDRESS", "auth:7300")
    settings = CodecSettings()
    assert (settings.listen, listen_host(settings.listen), settings.metrics_port) == ("[::]:7001", "::", -1)
    assert settings.log_level == "DEBUG"
    for field, value in (("metrics_port", -2), ("listen", "nohost"), ("log_level", "LOUD")):
        with pytest.raises(ValueError, match=field):
            CodecSettings(**{field: value})


def test_main_announces_ports_and_stops_on_sigterm(auth: AuthFixture) -> None:
    env = {
        **os.environ,
        "NEBULA_CODEC_CLUSTER_ID": "a",
        "NEBULA_CODEC_AUTH_ADDRESS": auth.address,
        "NEBULA_CODEC_LISTEN": "127.0.0.1:0",
        "NEBULA_CODEC_METRICS_PORT": "0",
        "NEBULA_CODEC_CALIBRATION_CACHE": "off",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "services.codec"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout=30):
                pytest.fail("nebula-codec printed no startup line within 30 s")
        announcement = json.loads(process.stdout.readline())
        assert announcement["service"] == "codec"
        assert announcement["grpc_port"] > 0 and announcement["metrics_port"] > 0

        with grpc.insecure_channel(f"127.0.0.1:{announcement['grpc_port']}") as channel:
            stub = codec_pb2_grpc.CodecStub(channel)
            response = stub.ListCodecs(
                codec_pb2.ListCodecsRequest(), metadata=bearer_metadata(auth.token), timeout=10
            )
            assert "int8" in response.codecs
            with pytest.raises(grpc.RpcError) as refused:
                stub.ListCodecs(codec_pb2.ListCodecsRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
        assert process.stdout.read() == ""  # exactly one line on stdout
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# --- streaming and advice ---------------------------------------------------------------------------


def test_encode_and_decode_streams_carry_large_tensors_in_chunks() -> None:
    # 4 MiB of float32: larger than one chunk, sent in uneven pieces; two tensors on one call.
    tensors = [torch.randn(1024, 1024), torch.randn(3, 5)]
    specs = ["fp16(svd(0.1))", "zstd(int8)"]

    async def check(stub: codec_pb2_grpc.CodecStub, _: grpc.aio.Channel, __: ServiceServer) -> None:
        async def requests() -> AsyncIterator[codec_pb2.EncodeStreamRequest]:
            for spec, tensor in zip(specs, tensors, strict=True):
                dtype, shape, data = tensor_to_raw(tensor)
                yield codec_pb2.EncodeStreamRequest(
                    start=codec_pb2.EncodeStart(codec=spec, dtype=dtype, shape=shape)
                )
                for offset in range(0, len(data), 300_001):
                    yield codec_pb2.EncodeStreamRequest(data=data[offset : offset + 300_001])

        frames = [frame async for frame in stub.EncodeStream(requests())]
        headers = [frame.header for frame in frames if frame.HasField("header")]
        assert [h.codec for h in headers] == specs and [h.frame_id for h in headers] == [1, 2]
        for header, tensor, spec in zip(headers, tensors, specs, strict=True):
            assert header.payload_size == len(encode_tensor(tensor, spec).payload)
        parts = [part async for part in stub.DecodeStream(frames)]
        infos = [i for i, p in enumerate(parts) if p.HasField("info")]
        assert len(infos) == 2
        for number, start in enumerate(infos):
            info = parts[start].info
            end = infos[number + 1] if number + 1 < len(infos) else len(parts)
            data = b"".join(p.data for p in parts[start + 1 : end])
            assert info.size == len(data) and info.frame_id == number + 1
            decoded = raw_to_tensor(info.dtype, info.shape, data)
            reference = encode_tensor(tensors[number], specs[number])
            assert torch.equal(decoded, decode_tensor(reference.header, reference.payload))

    _serve(check)


def test_malformed_streams_end_with_invalid_argument_naming_the_problem() -> None:
    async def check(stub: codec_pb2_grpc.CodecStub, _: grpc.aio.Channel, __: ServiceServer) -> None:
        start = codec_pb2.EncodeStart(codec="int8", dtype="float32", shape=[4])

        async def collect(call: object) -> None:
            async for _ in call:  # type: ignore[attr-defined]
                pass

        cases = [
            ([codec_pb2.EncodeStreamRequest(data=b"1234")], "before a start"),
            (
                [codec_pb2.EncodeStreamRequest(start=start), codec_pb2.EncodeStreamRequest(data=bytes(20))],
                "20 bytes",
            ),
            (
                [codec_pb2.EncodeStreamRequest(start=start), codec_pb2.EncodeStreamRequest(data=bytes(8))],
                "ended after 8",
            ),
            (
                [
                    codec_pb2.EncodeStreamRequest(
                        start=codec_pb2.EncodeStart(codec="delta(int8)", dtype="float32")
                    )
                ],
                "trainer stream",
            ),
            (
                [codec_pb2.EncodeStreamRequest(start=codec_pb2.EncodeStart(codec="int8", dtype="int3"))],
                "start.dtype",
            ),
        ]
        for messages, expected in cases:
            details = await _expect_invalid(collect(stub.EncodeStream(iter(messages))))
            assert expected in details, (expected, details)
        frames = list(to_frames(encode_tensor(torch.randn(100), "int8"), chunk_size=64))
        details = await _expect_invalid(collect(stub.DecodeStream(iter(frames[:-1]))))
        assert "middle of a frame" in details
        frames[0].header.shape[:] = [50, 2]
        details = await _expect_invalid(collect(stub.DecodeStream(iter(frames))))
        assert "checksum" in details

    _serve(check)


def test_advise_ranks_specs_from_a_cached_host_calibration(tmp_path: Path) -> None:
    cache = tmp_path / "calibration.json"
    request = job_advice_request(
        bandwidth_bps=60e6,
        rtt_seconds=0.04,
        edge="encoder->decoder",
        activation_shape=(64, 12, 128),
        micro_batches=2,
        compute_seconds=0.02,
    )
    request.candidates = ["none", "fp16", "int8", "fp16(svd(0.9))", "fp16(lowrank(8))"]

    async def check(stub: codec_pb2_grpc.CodecStub, _: grpc.aio.Channel, __: ServiceServer) -> None:
        response = await stub.Advise(request_to_proto(request), timeout=120)
        result = result_from_proto(response)
        assert [d.direction for d in result.directions] == ["forward", "backward"]
        for direction in result.directions:
            assert direction.error_source == "synthetic"
            ranked = [(not o.within_budget, o.direction_seconds) for o in direction.options]
            assert ranked == sorted(ranked)
            none = next(o for o in direction.options if o.spec == "none")
            assert none.ratio == 1.0 and none.rel_error == 0.0
            svd = next(o for o in direction.options if o.spec == "fp16(svd(0.9))")
            assert "sent whole with fp16" in svd.note and svd.ratio == pytest.approx(0.5, abs=1e-4)
            for option in direction.options:
                assert option.encode_seconds > 0 and option.decode_seconds > 0
                assert option.transfer_seconds == pytest.approx(option.encoded_bytes * 8 / 60e6)
        assert result.predicted_step_seconds < result.baseline_step_seconds
        assert result.forward_spec != "none"
        details = await _expect_invalid(stub.Advise(codec_pb2.AdviseRequest(bandwidth_bps=0)))
        assert "bandwidth_bps" in details

    _serve(check, calibration_cache=str(cache))
    saved = json.loads(cache.read_text())
    assert "LowRankTransform" in saved["fits"] and saved["host"]

    async def cached(stub: codec_pb2_grpc.CodecStub, _: grpc.aio.Channel, __: ServiceServer) -> None:
        response = await stub.Advise(request_to_proto(request), timeout=120)
        assert response.calibration_cached

    _serve(cached, calibration_cache=str(cache))


def test_advice_client_calls_the_service_sync_and_async() -> None:
    request = job_advice_request(
        bandwidth_bps=10e6, rtt_seconds=0.1, edge="e", activation_shape=(8, 4, 16), micro_batches=1
    )
    request.candidates = ["none", "int8"]

    async def check(_: codec_pb2_grpc.CodecStub, __: grpc.aio.Channel, server: ServiceServer) -> None:
        address = f"127.0.0.1:{server.ports['grpc']}"
        token = _AUTH[-1].token
        result = await advise_specs(address, request, token=token)
        assert (result.forward_spec, result.backward_spec) == ("int8", "int8")
        sync = await asyncio.to_thread(advise_specs_sync, address, request, token=token)
        assert sync.forward_spec == "int8"
        bad = job_advice_request(bandwidth_bps=1e6, rtt_seconds=0.0, edge="e", activation_shape=(4,))
        bad.candidates = ["ef(int8)"]
        with pytest.raises(CodecError, match="stream option"):
            await advise_specs(address, bad, token=token)
        with pytest.raises(AdviceUnavailableError, match="UNAUTHENTICATED"):
            await advise_specs(address, request)

    _serve(check)
    with pytest.raises(AdviceUnavailableError, match="could not advise"):
        advise_specs_sync("127.0.0.1:1", request, timeout=2)
