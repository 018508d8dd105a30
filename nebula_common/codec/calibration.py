"""Host calibration: how many seconds each codec component costs per unit of work on *this* machine.

A codec's encode/decode time is predicted as the sum, over its ``cost_terms``, of
``a + b * units`` with (a, b) fitted per component from timings taken here: an
elementwise codec's unit is an element, a factorisation's its flop estimate, zstd's
an input byte. Measuring each component on two sizes (rather than every spec on
every shape) keeps calibration to about a second while still predicting nested
specs (``fp16(svd(0.6))`` = svd + fp16 on the factors) and any shape.

Results are cached as JSON keyed by a host fingerprint (machine, CPU count,
torch version and thread count, calibration version), so a restarted service
reuses them; a cache from another host or version is ignored.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nebula_common.codec.base import numel
from nebula_common.codec.registry import get_codec
from nebula_common.durable import atomic_write

log = logging.getLogger(__name__)

CALIBRATION_VERSION = 1
_REPEATS = 3

PROBES: dict[str, tuple[str, tuple[tuple[int, int], ...]]] = {
    # component key: (probe spec, two matrix shapes to time it on)
    "none": ("none", ((256, 256), (1024, 512))),
    "fp16": ("fp16", ((256, 256), (1024, 512))),
    "bf16": ("bf16", ((256, 256), (1024, 512))),
    "int8": ("int8", ((256, 256), (1024, 512))),
    "int8-group": ("int8(scale=block)", ((256, 256), (1024, 512))),
    "int4-group": ("int4", ((256, 256), (1024, 512))),
    "SvdTransform": ("svd(0.25)", ((256, 128), (512, 256))),
    "LowRankTransform": ("lowrank(16)", ((512, 256), (2048, 512))),
    "PowerSgdTransform": ("powersgd(16)", ((512, 256), (2048, 512))),
    "TopkTransform": ("topk(0.01)", ((256, 256), (1024, 512))),
    "zstd-3": ("zstd(int8)", ((256, 256), (1024, 512))),
}
"""Components calibrated at start-up; others (zstd levels, plug-ins) are calibrated on first use."""


@dataclass
class Fit:
    """seconds = intercept + slope * units, for encode and decode separately."""

    encode: tuple[float, float]
    decode: tuple[float, float]

    def predict(self, units: float) -> tuple[float, float]:
        return (
            max(0.0, self.encode[0] + self.encode[1] * units),
            max(0.0, self.decode[0] + self.decode[1] * units),
        )


@dataclass
class Calibration:
    """Fitted costs per component for one host."""

    host: str
    created: float
    fits: dict[str, Fit] = field(default_factory=dict)
    cached: bool = False

    def to_json(self) -> dict[str, object]:
        return {
            "version": CALIBRATION_VERSION,
            "host": self.host,
            "created": self.created,
            "fits": {k: {"encode": list(f.encode), "decode": list(f.decode)} for k, f in self.fits.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Calibration:
        fits_raw = data["fits"]
        if not isinstance(fits_raw, dict):
            raise ValueError("fits must be an object")
        fits = {
            str(key): Fit(tuple(value["encode"]), tuple(value["decode"]))  # type: ignore[arg-type]
            for key, value in fits_raw.items()
        }
        return cls(host=str(data["host"]), created=float(data["created"]), fits=fits, cached=True)  # type: ignore[arg-type]


def host_fingerprint() -> str:
    """What makes timings comparable: machine, CPU count, torch version and intra-op threads."""
    return (
        f"{platform.node()}|{platform.machine()}|cpus={os.cpu_count()}|torch={torch.__version__}"
        f"|threads={torch.get_num_threads()}|v{CALIBRATION_VERSION}"
    )


def _probe_data(shape: tuple[int, int]) -> torch.Tensor:
    """Activation-like data (a decaying spectrum plus noise) so low-rank probes do representative work."""
    generator = torch.Generator().manual_seed(1234)
    m, n = shape
    rank = min(32, m, n)
    left = torch.randn(m, rank, generator=generator)
    right = torch.randn(rank, n, generator=generator) * torch.logspace(0, -2, rank).unsqueeze(1)
    return left @ right + 0.05 * torch.randn(m, n, generator=generator)


def _time(fn: object) -> float:
    """Median of a few runs after one warm-up run."""
    assert callable(fn)
    fn()
    samples = []
    for _ in range(_REPEATS):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    samples.sort()
    return samples[len(samples) // 2]


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares line through (units, seconds) points, slope clamped >= 0, intercept >= 0."""
    if len(points) == 1 or points[0][0] == points[-1][0]:
        units, seconds = points[-1]
        return 0.0, seconds / units if units else 0.0
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / var)
    return max(0.0, mean_y - slope * mean_x), slope


def probe_for(key: str) -> tuple[str, tuple[tuple[int, int], ...]]:
    """The probe for a component key: the table above, ``zstd-L`` for any level, else the key as a spec."""
    if key in PROBES:
        return PROBES[key]
    if key.startswith("zstd-") and key[5:].isdigit():
        return f"zstd(int8,{int(key[5:])})", PROBES["zstd-3"][1]
    return key, ((256, 256), (1024, 512))


class CalibrationStopped(RuntimeError):
    """The calibrator was closed before a calibration finished (the service is stopping)."""


class Calibrator:
    """Runs (or loads) the host calibration once, in the background, and fits components on demand."""

    def __init__(self, cache_path: Path | None) -> None:
        self.cache_path = cache_path
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._calibration: Calibration | None = None
        self._error: BaseException | None = None
        self._started = False
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Calibrate (or load the cache) on a daemon thread so service start-up is not delayed; idempotent."""
        with self._lock:
            if self._started or self._stopping.is_set():
                return
            self._started = True
        self._thread = threading.Thread(target=self._run, name="codec-calibration", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stop a calibration in progress (between two measurements) and wait for its thread.

        A process must not exit while this thread is inside torch: the interpreter
        tears torch down under it and the C++ runtime aborts ("terminate called
        without an active exception"). Waiters on ``get`` are woken with an error.
        """
        self._stopping.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.warning("codec calibration did not stop within %.0f s", timeout)
        if not self._ready.is_set():
            self._error = CalibrationStopped("the codec service is stopping")
            self._ready.set()

    def _run(self) -> None:
        try:
            self._calibration = self._load() or self._measure_all()
        except CalibrationStopped as exc:
            log.info("codec calibration stopped: %s", exc)
            self._error = exc
        except BaseException as exc:  # reported to every Advise caller instead of dying silently
            log.exception("codec calibration failed")
            self._error = exc
        finally:
            self._ready.set()

    def get(self, timeout: float | None = None) -> Calibration:
        """The calibration, waiting (at most ``timeout`` seconds) for it; starts it if nobody has."""
        self.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("codec calibration is still running")
        if self._error is not None:
            raise RuntimeError(f"codec calibration failed: {self._error}")
        assert self._calibration is not None
        return self._calibration

    def run_now(self) -> Calibration:
        """Synchronous calibration (CLI, benchmarks, tests)."""
        with self._lock:
            self._started = True
        self._run()
        return self.get(0)

    def fit(self, key: str) -> Fit:
        """The fit for ``key``, measuring and caching it first if this host has not yet."""
        calibration = self.get()
        with self._lock:
            fit = calibration.fits.get(key)
            if fit is None:
                fit = _measure(key, calibration)
                calibration.fits[key] = fit
                self._save(calibration)
            return fit

    def predict(self, spec: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[float, float]:
        """Predicted (encode, decode) seconds of ``spec`` on one tensor of ``shape``."""
        encode = decode = 0.0
        for key, units in get_codec(spec).cost_terms(shape, dtype):
            enc, dec = self.fit(key).predict(units)
            encode += enc
            decode += dec
        return encode, decode

    def _measure_all(self) -> Calibration:
        calibration = Calibration(host=host_fingerprint(), created=time.time())
        started = time.perf_counter()
        for key in PROBES:
            if self._stopping.is_set():
                raise CalibrationStopped("calibration stopped before it finished")
            calibration.fits[key] = _measure(key, calibration)
        log.info(
            "codec calibration done", extra={"fields": {"seconds": round(time.perf_counter() - started, 3)}}
        )
        self._save(calibration)
        return calibration

    def _load(self) -> Calibration | None:
        if self.cache_path is None or not self.cache_path.is_file():
            return None
        try:
            data = json.loads(self.cache_path.read_text())
            if data.get("version") != CALIBRATION_VERSION or data.get("host") != host_fingerprint():
                return None
            return Calibration.from_json(data)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable codec calibration cache %s: %s", self.cache_path, exc)
            return None

    def _save(self, calibration: Calibration) -> None:
        if self.cache_path is None:
            return
        try:
            # Unique temp name + atomic replace: concurrent services sharing a cache never tear it.
            atomic_write(self.cache_path, json.dumps(calibration.to_json(), indent=1).encode(), mode=0o644)
        except OSError as exc:  # a read-only filesystem costs a re-calibration next start, nothing more
            log.warning("could not cache codec calibration at %s: %s", self.cache_path, exc)


def _measure(key: str, calibration: Calibration) -> Fit:
    """Time the probe for ``key`` at two sizes; subtract the other terms' already-fitted cost."""
    spec, shapes = probe_for(key)
    codec = get_codec(spec)
    enc_points: list[tuple[float, float]] = []
    dec_points: list[tuple[float, float]] = []
    for shape in shapes:
        data = _probe_data(shape)
        payload = codec.encode(data)
        enc = _time(lambda data=data: codec.encode(data))
        dec = _time(lambda payload=payload, shape=shape: codec.decode(payload, shape, torch.float32))
        units = 0.0
        for term, term_units in codec.cost_terms(shape, torch.float32):
            if term == key and units == 0.0:
                units = term_units
                continue
            other = calibration.fits.get(term)
            if other is not None:
                other_enc, other_dec = other.predict(term_units)
                enc, dec = enc - other_enc, dec - other_dec
        units = units or float(numel(shape))
        enc_points.append((units, max(enc, 0.0)))
        dec_points.append((units, max(dec, 0.0)))
    return Fit(encode=_line(enc_points), decode=_line(dec_points))


def default_cache_path() -> Path:
    """``$XDG_CACHE_HOME/nebula/codec-calibration.json`` (``~/.cache`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nebula" / "codec-calibration.json"
