"""The job report page from known numbers: every part present, values escaped, bad paths refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.codec_advice import LinkProfile
from nebula_common.sdk.job_records import JobRecord, StageView
from nebula_common.sdk.report import render_html, throughput_mbit, write_report
from nebula_common.sdk.summary import JobSummary

pytestmark = pytest.mark.timeout(120)  # a hang guard: the first matplotlib import builds its font cache
ADVICE = {
    "source": "codec-service advice",
    "forward": "fp16",
    "backward": "int8",
    "predicted_step_seconds": 0.2,
    "baseline_step_seconds": 0.5,
    "link": {"bandwidth_mbit": 60, "rtt_ms": 40},
    "alternatives": {"forward": [{"spec": "fp16", "ratio": 2.0, "rel_error": 0.001, "seconds": 0.01}]},
}


def record(message: str = "", choice: dict | None = None) -> JobRecord:
    stages = []
    for name, cluster in (("encoder", "a"), ("decoder", "b")):
        status = trainer_pb2.StageStatus(
            job_id="job-1",
            stage=name,
            state=trainer_pb2.STAGE_STATE_SUCCEEDED,
            steps_done=3,
            codec_choice=json.dumps(choice or ADVICE),
            message=message,
        )
        info = trainer_pb2.StageRecordInfo(
            status=status, owner=f"u-{cluster}", steps=3, edge="encoder->decoder"
        )
        stages.append(StageView.from_info(cluster, info))
    return JobRecord("job-1", stages)


def summary() -> JobSummary:
    result = JobSummary(
        "job-1", 3, losses=[2.0, 1.5, 1.0], step_seconds=[0.5, 0.25, 0.25], loss_stage="decoder"
    )
    result.wan_bytes_per_step = [1_000_000, 2_000_000, 2_500_000]
    result.wan = {
        "forward": {"from": "a", "to": "b", "bytes": 1000, "raw_bytes": 2000, "compression_ratio": 2.0}
    }
    return result


def test_throughput_per_step_is_the_steps_bytes_over_its_time() -> None:
    assert throughput_mbit(summary()) == pytest.approx([16.0, 32.0, 16.0])


def test_the_page_has_every_part_and_escapes_what_it_shows() -> None:
    page = render_html(summary(), record(message="<script>alert(1)</script>"), LinkProfile(60, 40))
    for part in ('id="chart-loss"', 'id="chart-step_time"', 'id="chart-wan"', 'id="wan"', 'id="advice"'):
        assert part in page
    assert page.count("<polyline") == 4  # loss, step time, this job's throughput, the link's line
    assert "link 60 Mbit/s" in page and "x2.00" in page and "2.0000 -&gt; 1.0000" in page
    assert "advised <b>fp16</b> forward and <b>int8</b> backward" in page and "500 ms uncompressed" in page
    assert "<script>" not in page and "&lt;script&gt;" in page


def test_the_trial_advisors_reasoning_is_on_the_page() -> None:
    trial = {
        "forward": "fp16",
        "backward": "int8",
        "trial_steps": 30,
        "loss_tolerance": 0.02,
        "reasons": [
            "link 60 Mbit/s, 40 ms RTT: none predicted 0.500 s/step",
            "topk<2%>: predicted 0.100 s/step (5.0x), trial loss 1.2 (+9.0%, over the 2% tolerance)",
            "chose fp16 / int8: the fastest predicted within tolerance",
        ],
    }
    page = render_html(summary(), record(choice={**ADVICE, "trial": trial}), LinkProfile(60, 40))
    assert "trial on the job itself (30 steps per candidate, loss tolerance 2% of none's)" in page
    assert "topk&lt;2%&gt;: predicted 0.100 s/step (5.0x)" in page  # escaped, each reason an item
    assert page.count("<li>") == 3 and "chose fp16 / int8" in page


def test_write_report_refuses_a_path_it_cannot_write_cleanly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"must end in \.html"):
        write_report(summary(), record(), None, tmp_path / "report.txt")
    with pytest.raises(ValueError, match="does not exist"):
        write_report(summary(), record(), None, tmp_path / "nowhere" / "report.html")
    page, _ = write_report(summary(), record(), None, tmp_path / "report.html")
    assert page.read_text().startswith("<!doctype html>") and "link</th><td>unknown" in page.read_text()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".png")) == ["report.html"]


def test_the_page_names_the_progress_rule_when_the_trial_used_it() -> None:
    trial = {"forward": "int8", "backward": "int8", "trial_steps": 90, "loss_tolerance": 0.02}
    trial |= {
        "progress_tolerance": 0.1,
        "reasons": ["x: trial loss 4.6 (+1.1%, +14% of the baseline's progress)"],
    }
    page = render_html(summary(), record(choice={**ADVICE, "trial": trial}), LinkProfile(60, 40))
    assert (
        "(90 steps per candidate, loss tolerance 2% of none's, gap at most 10% of none's trial progress)"
        in page
    )
