"""A job's report: one self-contained HTML page (and PNGs where matplotlib is installed: `.[report]`,
part of `.[dev]`).

What a person looks at after a run: the loss per step of each stage that has one, the step time,
the WAN throughput this job used against the link's bandwidth, the codec ratio each way, how each
stage ended, and which codecs were chosen and why (the codec service's advice with its ranked
alternatives, or "configured"). The charts are inline SVG drawn here, so the page needs no
network, no script and no plotting library to render; ``matplotlib``, when importable, also
writes each chart as a PNG next to the page for slides and tickets.

Inputs are what the SDK already has: the job's ``JobSummary`` (per-step numbers, per-job WAN
counters) and its ``JobRecord`` (stages, owners, how each ended, the codec choice).
"""

from __future__ import annotations

import html
import importlib.util
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nebula_common.durable import atomic_write
from nebula_common.sdk.job_records import JobRecord
from nebula_common.sdk.links import LinkProfile
from nebula_common.sdk.summary import JobSummary

WIDTH, HEIGHT, PAD = 640, 260, 48
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")


@dataclass(frozen=True)
class Series:
    label: str
    values: Sequence[float]
    dashed: bool = False


@dataclass(frozen=True)
class Chart:
    """One chart: a title, the y unit, and its series over steps 1..n."""

    slug: str
    title: str
    unit: str
    series: tuple[Series, ...]
    from_zero: bool = True  # False: the y axis spans the data (a loss curve is read by its shape)


def throughput_mbit(summary: JobSummary) -> list[float]:
    """The job's WAN throughput per step (Mbit/s, both directions): bytes sent in the step / its time."""
    rates, previous = [], 0
    for total, seconds in zip(summary.wan_bytes_per_step, summary.step_seconds, strict=False):
        step_bytes = total - previous if total >= previous else total  # a recovery restarts the counters
        previous = total
        rates.append(step_bytes * 8 / 1e6 / seconds if seconds > 0 else 0.0)
    return rates


def charts(summary: JobSummary, link: LinkProfile | None) -> list[Chart]:
    loss = [Series(f"{summary.loss_stage or 'loss'} (loss)", summary.losses)]
    loss += [Series(f"{stage} (own loss)", values) for stage, values in summary.local_losses.items()]
    rates = throughput_mbit(summary)
    wan = [Series("this job", rates)]
    if link is not None and rates:
        wan.append(
            Series(f"link {link.bandwidth_mbit:g} Mbit/s", [link.bandwidth_mbit] * len(rates), dashed=True)
        )
    return [
        Chart("loss", "Loss per step", "loss", tuple(loss), from_zero=False),
        Chart("step_time", "Step time", "ms", (Series("step", [s * 1000 for s in summary.step_seconds]),)),
        Chart("wan", "WAN throughput against the link", "Mbit/s", tuple(wan)),
    ]


def svg_chart(chart: Chart) -> str:
    """An inline SVG line chart (axes, 5 ticks a side, legend); empty series draw a note instead."""
    points = [v for s in chart.series for v in s.values if math.isfinite(v)]
    title = html.escape(chart.title)
    if not points:
        empty = '<text x="8" y="30">no data</text>'
        return f'<svg role="img" aria-label="{title}" width="{WIDTH}" height="60">{empty}</svg>'
    low, high = (min(0.0, min(points)) if chart.from_zero else min(points)), max(points)
    high = high if high > low else low + 1.0
    steps = max(len(s.values) for s in chart.series)
    plot_w, plot_h = WIDTH - 2 * PAD, HEIGHT - 2 * PAD

    def x(i: int) -> float:
        return PAD + (plot_w * i / (steps - 1) if steps > 1 else plot_w / 2)

    def y(v: float) -> float:
        return PAD + plot_h * (1 - (v - low) / (high - low))

    parts = [
        f'<svg role="img" aria-label="{title}" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" xmlns="http://www.w3.org/2000/svg" font-size="11">',
        f'<rect x="{PAD}" y="{PAD}" width="{plot_w}" height="{plot_h}" fill="#fafafa" stroke="#999"/>',
    ]
    for k in range(5):
        value = low + (high - low) * k / 4
        parts.append(f'<text x="{PAD - 4}" y="{y(value) + 4:.1f}" text-anchor="end">{value:.3g}</text>')
        parts.append(
            f'<line x1="{PAD}" x2="{PAD + plot_w}" y1="{y(value):.1f}" y2="{y(value):.1f}" stroke="#e4e4e4"/>'
        )
        step = round(1 + (steps - 1) * k / 4)
        parts.append(
            f'<text x="{x(step - 1):.1f}" y="{PAD + plot_h + 16}" text-anchor="middle">{step}</text>'
        )
    parts.append(f'<text x="{PAD + plot_w / 2}" y="{HEIGHT - 6}" text-anchor="middle">step</text>')
    parts.append(f'<text x="12" y="{PAD - 12}">{html.escape(chart.unit)}</text>')
    for n, series in enumerate(chart.series):
        colour = COLOURS[n % len(COLOURS)]
        coords = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(series.values) if math.isfinite(v))
        dash = ' stroke-dasharray="6 4"' if series.dashed else ""
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2"{dash} points="{coords}"/>')
        parts.append(
            f'<text x="{PAD + 8 + 170 * n}" y="{PAD - 12}" fill="{colour}">{html.escape(series.label)}</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts)


def write_pngs(chart_list: list[Chart], directory: Path, stem: str) -> list[Path]:
    """Each chart as ``<stem>-<slug>.png`` when matplotlib is importable (else none: the page has SVGs)."""
    if importlib.util.find_spec("matplotlib") is None:
        return []
    import matplotlib  # optional: only where it is installed

    matplotlib.use("Agg")
    from matplotlib import pyplot
    from matplotlib.ticker import MaxNLocator

    written = []
    for chart in chart_list:
        figure, axes = pyplot.subplots(figsize=(6.4, 2.6))
        for series in chart.series:
            axes.plot(
                range(1, len(series.values) + 1),
                series.values,
                "--" if series.dashed else "-",
                label=series.label,
            )
        axes.set_title(chart.title)
        axes.set_xlabel("step")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        if chart.from_zero:
            axes.set_ylim(bottom=0)
        axes.set_ylabel(chart.unit)
        axes.legend()
        path = directory / f"{stem}-{chart.slug}.png"
        figure.savefig(path, dpi=100, bbox_inches="tight")
        pyplot.close(figure)
        written.append(path)
    return written


def _rows(rows: list[tuple[str, str]]) -> str:
    return "\n".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)


def codec_choice(record: JobRecord) -> dict[str, Any]:
    """The codec choice the stages were assigned with (the same in each: it is part of the spec)."""
    for stage in record.stages:
        if stage.codec_choice:
            choice = json.loads(stage.codec_choice)
            if isinstance(choice, dict):
                return choice
    return {"source": "unknown"}


def advice_section(choice: dict[str, Any]) -> str:
    """Which codecs and why: 'configured' in the spec, or the advice with its ranked alternatives.

    A chain's choice (``per-edge``) has one such section per edge, headed by the edge's name.
    """
    if choice.get("source") == "per-edge":
        return "\n".join(
            f"<h3>edge {html.escape(str(record.get('edge')))}</h3>\n{advice_section(record)}"
            for record in choice.get("edges") or []
        )
    if choice.get("source") != "codec-service advice":
        return f"<p>Codecs were <b>{html.escape(str(choice.get('source', 'unknown')))}</b> in the spec.</p>"
    link = choice.get("link", {})
    lines = [
        f"<p>The codec service advised <b>{html.escape(str(choice.get('forward')))}</b> forward and "
        f"<b>{html.escape(str(choice.get('backward')))}</b> backward for a "
        f"{link.get('bandwidth_mbit', '?')} Mbit/s, {link.get('rtt_ms', '?')} ms RTT link: predicted step "
        f"{float(choice.get('predicted_step_seconds', 0)) * 1000:.0f} ms against "
        f"{float(choice.get('baseline_step_seconds', 0)) * 1000:.0f} ms uncompressed.</p>",
        *([f"<p>The link: {html.escape(str(link['source']))}.</p>"] if link.get("source") else []),
        "<table><tr><th>direction</th><th>spec</th><th>ratio</th><th>rel. error</th><th>seconds</th></tr>",
    ]
    for direction, options in (choice.get("alternatives") or {}).items():
        for option in options:
            lines.append(
                f"<tr><td>{html.escape(direction)}</td><td>{html.escape(str(option.get('spec')))}</td>"
                f"<td>{float(option.get('ratio', 0)):.2f}</td>"
                f"<td>{float(option.get('rel_error', 0)):.4f}</td>"
                f"<td>{float(option.get('seconds', 0)):.4f}</td></tr>"
            )
    lines.append("</table>")
    trial = choice.get("trial")
    if isinstance(trial, dict):
        progress = trial.get("progress_tolerance")
        progress_rule = (
            f", gap at most {float(progress):.0%} of none's trial progress"
            if isinstance(progress, (int, float))
            else ""
        )
        lines.append(
            f"<p>Then a trial on the job itself ({html.escape(str(trial.get('trial_steps', '?')))} steps per "
            f"candidate, loss tolerance {float(trial.get('loss_tolerance', 0)):.0%} of none's"
            f"{progress_rule}) chose "
            f"<b>{html.escape(str(trial.get('forward')))}</b> forward and "
            f"<b>{html.escape(str(trial.get('backward')))}</b> backward:</p>"
        )
        lines.append('<ul class="trial">')
        lines += [f"<li>{html.escape(str(reason))}</li>" for reason in trial.get("reasons") or []]
        lines.append("</ul>")
    return "\n".join(lines)


STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 720px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 8px 0; } th, td { padding: 3px 10px; text-align: left; }
th { color: #555; font-weight: 600; white-space: nowrap; } td { overflow-wrap: anywhere; }
tr:nth-child(even) { background: #f6f6f6; }
.state { font-weight: 700; } .SUCCEEDED { color: #1a7f37; } .FAILED { color: #c62828; }
.CANCELLED { color: #a15c00; }
"""


def render_html(summary: JobSummary, record: JobRecord, link: LinkProfile | None) -> str:
    """The whole page as a string (no external resources)."""
    state = record.state
    overview = [
        ("state", state),
        ("steps", f"{record.steps_done}/{record.steps}"),
        (
            "loss first -> last",
            f"{summary.losses[0]:.4f} -> {summary.losses[-1]:.4f}" if summary.losses else "-",
        ),
        ("mean step time", f"{summary.mean_step_seconds * 1000:.1f} ms"),
        ("owners", ", ".join(f"{c}: {o}" for c, o in record.owners.items())),
        ("stages", ", ".join(f"{s} @ {c}" for s, c in record.clusters.items())),
        ("spec digest", record.spec_digest or "-"),
        ("link", f"{link.bandwidth_mbit:g} Mbit/s, {link.rtt_ms:g} ms RTT" if link else "unknown"),
    ]
    wan_rows = []
    for direction, wan in summary.wan.items():
        route = f"{wan.get('from')} -> {wan.get('to')}"
        wan_rows.append(
            f"<tr><td>{direction}</td><td>{html.escape(route)}</td>"
            f"<td>{wan.get('bytes', wan.get('payload_bytes', 0)):,}</td><td>{wan.get('raw_bytes', 0):,}</td>"
            f"<td>x{wan.get('compression_ratio', 0.0):.2f}</td><td>{wan.get('frames', '-')}</td>"
            f"<td>{html.escape(str(wan.get('counted_by', '')))}</td></tr>"
        )
    ended = "\n".join(
        f"<tr><td>{html.escape(s.stage)}</td><td>{html.escape(s.cluster)}</td>"
        f'<td class="state {s.state}">{s.state}</td><td>{html.escape(s.message or "-")}</td></tr>'
        for s in record.stages
    )
    figures = "\n".join(
        f'<figure id="chart-{c.slug}"><figcaption>{html.escape(c.title)}</figcaption>{svg_chart(c)}</figure>'
        for c in charts(summary, link)
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Nebula job {html.escape(record.job_id)}</title>
<style>{STYLE}</style></head>
<body>
<h1>Job {html.escape(record.job_id)} <span class="state {state}">{state}</span></h1>
<table id="overview">{_rows(overview)}</table>
<h2>Training</h2>
{figures}
<h2>WAN, this job only</h2>
<table id="wan"><tr><th>direction</th><th>clusters</th><th>bytes</th><th>raw bytes</th><th>codec ratio</th>
<th>frames</th><th>counted by</th></tr>
{"".join(wan_rows)}
</table>
<h2>Codec choice</h2>
<div id="advice">{advice_section(codec_choice(record))}</div>
<h2>How each stage ended</h2>
<table id="stages"><tr><th>stage</th><th>cluster</th><th>state</th><th>message</th></tr>
{ended}
</table>
</body></html>
"""


def write_report(
    summary: JobSummary, record: JobRecord, link: LinkProfile | None, path: Path
) -> tuple[Path, list[Path]]:
    """Write the page (atomically) and, with matplotlib, a PNG per chart beside it; returns both."""
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"report path {path} must end in .html")
    if not path.parent.is_dir():
        raise ValueError(f"report directory {path.parent} does not exist")
    atomic_write(path, render_html(summary, record, link).encode(), mode=0o644)
    return path, write_pngs(charts(summary, link), path.parent, path.stem)


__all__ = ["render_html", "svg_chart", "throughput_mbit", "write_report"]
