"""`nebula job report` on a real job of the shared deployment, rendered by headless Chromium.

The page is written by the CLI in this process; Chromium (the Debian package, installed by
``.ci/run``) renders it as a browser would: ``--dump-dom`` gives the DOM after parsing (the charts
are inline SVG, so they are in it), ``--screenshot`` a PNG we check is a real, non-blank picture.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nebula_common.cli.app import app
from nebula_common.launcher import LocalDeployment
from nebula_common.sdk.api import Deployment

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
BROWSER_TIMEOUT_S = 120


def chromium(*args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars"]
    return subprocess.run(
        [CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S, check=False
    )


def png_size(path: Path) -> tuple[int, int]:
    """A PNG's width and height from its header (after checking the signature)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def distinct_rows(path: Path) -> int:
    """How many distinct pixel rows a PNG has (decoded by hand: a blank page has one)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    chunks, offset, height = b"", 8, 0
    while offset < len(data):
        length, kind = struct.unpack(">I4s", data[offset : offset + 8])
        body = data[offset + 8 : offset + 8 + length]
        if kind == b"IHDR":
            _width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            chunks += body
        offset += 12 + length
    raw = zlib.decompress(chunks)
    stride = len(raw) // height
    return len({raw[row * stride + 1 : (row + 1) * stride] for row in range(height)})


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed (apt-get install chromium; .ci/run does)"
)
def test_the_report_page_renders_in_chromium_with_every_part(
    deployment: LocalDeployment, tmp_path: Path
) -> None:
    description = tmp_path / "deployment.json"
    deployment.write_description(description)
    with Deployment.open(description) as target:
        job = target.submit(
            ROOT / "examples" / "digit_sum" / "job.yaml",
            {"steps": 5, "edges.0.codec.forward": "fp16", "edges.0.codec.backward": "int8"},
        )
        job.wait()
    page = tmp_path / "report.html"
    result = CliRunner().invoke(
        app, ["job", "report", job.id, "--deployment", str(description), "--out", str(page), "--json"]
    )
    assert result.exit_code == 0, result.output
    written = json.loads(result.stdout)
    assert written["html"] == str(page)
    # One PNG per chart beside the page (matplotlib, a dev/report dependency): real pictures, not blanks.
    pngs = sorted(Path(p) for p in written["png"])
    assert [p.name for p in pngs] == [f"report-{c}.png" for c in ("loss", "step_time", "wan")]
    for png in pngs:
        width, height = png_size(png)
        assert 400 <= width <= 1200 and 150 <= height <= 600, (png, width, height)
        assert png.stat().st_size > 8_000, f"{png} is too small to hold a chart"
        assert distinct_rows(png) > 40, f"{png} is (nearly) blank"

    dom = chromium("--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr
    text = dom.stdout
    assert f"Job {job.id}" in text and "SUCCEEDED" in text
    for chart in ("chart-loss", "chart-step_time", "chart-wan"):
        assert f'id="{chart}"' in text and "<polyline" in text.split(f'id="{chart}"')[1].split("</figure>")[0]
    assert "link 100 Mbit/s" in text  # the throughput chart's reference line: the deployment's link
    assert "x2.00" in text and "x3.9" in text  # fp16 forward, int8 backward (a scale per tensor)
    assert "configured" in text  # the codec choice section
    assert text.count('class="state SUCCEEDED"') == 3  # the title and both stages

    shot = tmp_path / "report.png"
    rendered = chromium(f"--screenshot={shot}", "--window-size=800,1400", page.as_uri())
    assert rendered.returncode == 0 and shot.is_file(), rendered.stderr
    assert distinct_rows(shot) > 50, "the screenshot is (nearly) blank"
