"""`nebula demo`: PKI, two clusters, one account each, a built-in job over the emulated WAN, a summary.

The demo's job is an ordinary user job (``nebula_common/jobspec/builtin/<name>``:
a YAML spec plus one module per stage), submitted exactly as ``nebula job
submit`` would; the options below override fields of that spec.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import typer

from nebula_common.cli.console import new_console
from nebula_common.cli.demo_compare import Comparison, choice_of
from nebula_common.cli.job import follow, onboard, print_summary
from nebula_common.errors import NebulaError
from nebula_common.launcher import LocalDeployment
from nebula_common.rpc.internal_tls import PLAINTEXT_ENV, warn_plaintext
from nebula_common.sdk.client import ClusterSession
from nebula_common.sdk.deployment import ENDPOINTS, DeploymentTarget, write_endpoints_file
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.links import LinkProfile

console = new_console()
DEMO_JOBS = ("numbers", "electra")
"""Built-in jobs that run from scratch in a couple of minutes on a laptop (``abnet`` needs its text data)."""
COMPARE_STEPS = 100
"""Steps of each job when the demo compares none with auto: long enough that auto's one-off costs
(probing the job, measuring the link, advice, its trial: about 12 s on 2 busy cores) are a small part
of the job, short enough that both jobs fit the demo's 3 minutes on the default link."""
DEMO_BANDWIDTH_MBIT = 5.0
"""The demo's WAN: 5 Mbit/s a direction, where the numbers job's step is link-bound (~760 ms with codec
none against ~100 ms of compute), the regime Nebula is for."""


def _create_account(deployment: LocalDeployment, cluster: str, username: str) -> ClusterSession:
    """Each organisation creates its own account with its own admin; tokens never cross clusters."""
    return onboard(deployment.endpoints(cluster), deployment.cluster_state[cluster].admin_password, username)


def _pipeline(job: ProgramJob) -> str:
    pipeline = job.spec.pipeline
    if pipeline.mode == "one_way":
        return (
            f"one-way (no gradient back, sync lag {pipeline.sync_lag}), "
            f"{job.spec.stages[1].replicas} {job.spec.stages[1].name} replica(s)"
        )
    return f"schedule {pipeline.schedule}"


def demo(
    job_name: str = typer.Option("numbers", "--job", help=f"Which built-in job: {', '.join(DEMO_JOBS)}."),
    steps: int = typer.Option(
        None,
        min=1,
        help=f"Optimizer steps (default: the job's, 60; {COMPARE_STEPS} when comparing none with auto).",
    ),
    bandwidth_mbit: float = typer.Option(
        DEMO_BANDWIDTH_MBIT, min=0.001, help="Emulated WAN bandwidth per direction (Mbit/s)."
    ),
    delay_ms: float = typer.Option(20.0, min=0.0, help="Emulated one-way WAN delay (ms)."),
    codec_forward: str = typer.Option(
        None,
        help="Codec for what crosses a->b, e.g. fp16, int8, auto. Without either codec option the demo "
        "runs the job twice, with none and with auto, and compares them.",
    ),
    codec_backward: str = typer.Option(None, help="Codec for activation gradients b->a (default none)."),
    micro_batches: int = typer.Option(
        None, min=1, help="Micro-batches per step (pipelined across the WAN; default: the job's)."
    ),
    batch_size: int = typer.Option(None, min=1, help="Examples per step (default: the job's, 128)."),
    schedule: str = typer.Option(None, help="Pipeline schedule across the WAN: gpipe or 1f1b (numbers)."),
    replicas: int = typer.Option(
        None, min=1, help="Data-parallel processes of the downstream stage (electra: discriminators, 2)."
    ),
    json_path: Path = typer.Option(None, "--json", help="Write the JSON summary here."),
    run_dir: Path = typer.Option(None, help="Where PKI, data and logs go (default runs/demo-<time>)."),
    dev_plaintext_internal: bool = typer.Option(
        False,
        "--dev-plaintext-internal",
        hidden=True,
        help="Development only: plaintext internal ports (to measure what TLS costs). Logs a warning.",
    ),
) -> None:
    """Run a built-in split job across two simulated clusters and print what crossed the WAN."""
    if job_name not in DEMO_JOBS:
        raise typer.BadParameter(f"--job {job_name!r}: expected one of {', '.join(DEMO_JOBS)}")
    given: dict[str, Any] = {
        "steps": steps,
        "data.micro_batches": micro_batches,
        "data.batch_size": batch_size,
        "pipeline.schedule": schedule,
        "edges.0.codec.forward": codec_forward,
        "edges.0.codec.backward": codec_backward,
        "stages.1.replicas": replicas,
    }
    overrides = {key: value for key, value in given.items() if value is not None}  # else the spec's value
    pair = comparison_jobs(job_name, overrides) if codec_forward is None and codec_backward is None else None
    compare = pair is not None
    if pair is not None:  # none first, then auto: the same job on the same link
        baseline, job = pair
        directions = "both directions" if job.spec.edge.codec.backward == "auto" else "forward"
        codecs_line = f"codecs none, then auto ({directions})"
    else:
        job = _job(job_name, overrides)
        codecs_line = f"codecs forward={job.spec.edge.codec.forward} backward={job.spec.edge.codec.backward}"
    run_dir = run_dir or Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    console.print(
        f"[bold]Nebula demo[/] ({job_name}): clusters a and b, WAN {bandwidth_mbit:g} Mbit/s, "
        f"{delay_ms:g} ms one-way; {codecs_line}; {_pipeline(job)}; run dir {run_dir}"
    )
    started = time.perf_counter()
    if dev_plaintext_internal:
        os.environ[PLAINTEXT_ENV] = "1"  # the explicit development flag, for this process and the services
        warn_plaintext("nebula demo --dev-plaintext-internal")
    deployment = LocalDeployment(
        run_dir=run_dir,
        bandwidth_mbit=bandwidth_mbit,
        delay_ms=delay_ms,
        internal_tls=not dev_plaintext_internal,
    )
    try:
        with console.status("starting PKI, auth, codec, switches, WAN emulator and trainers ..."):
            deployment.start()  # stops whatever it started if any process fails to come up
        console.print(f"clusters up in {time.perf_counter() - started:.1f}s (logs: {deployment.log_dir})")
        # The run directory describes itself, so the job can be found again after the demo stopped
        # everything: `nebula job list|status|report --deployment <run dir>` read the trainers' records.
        deployment.write_description(run_dir / "deployment.json")
        write_endpoints_file(DeploymentTarget.load(run_dir / "deployment.json"), run_dir / ENDPOINTS)
        sessions = {c: _create_account(deployment, c, f"researcher-{c}") for c in ("a", "b")}
        link = LinkProfile(bandwidth_mbit=bandwidth_mbit, rtt_ms=2 * delay_ms)
        comparison = None
        if compare:
            console.print("1/2: the job with codec none")
            clock = time.perf_counter()
            reference = follow(baseline, sessions, link=link)
            reference_seconds = time.perf_counter() - clock
            console.print("2/2: the same job with codec auto")
        clock = time.perf_counter()
        summary = follow(job, sessions, link=link)
        if compare:
            seconds = time.perf_counter() - clock
            comparison = Comparison(
                reference, reference_seconds, summary, seconds, choice_of(job.codec_choice)
            )
    except NebulaError as exc:
        console.print(f"[red]demo failed:[/] {exc}")
        raise typer.Exit(1) from exc
    finally:
        with console.status("stopping every process ..."):
            deployment.stop()
    summary.total_seconds = time.perf_counter() - started
    summary.settings.update(
        job=job_name, bandwidth_mbit=bandwidth_mbit, delay_ms=delay_ms, run_dir=str(run_dir)
    )
    print_summary(summary)
    if comparison is not None and comparison.missing:  # a failed job has nothing to compare
        console.print(comparison.missing, markup=False, highlight=False)
    elif comparison is not None:
        console.print(comparison.table())
        console.print(comparison.verdict(), markup=False, highlight=False)
    console.print(
        f"the job again, now that the clusters are stopped: nebula job list --deployment {run_dir} "
        f"(or status|report {summary.job_id})",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    if json_path is not None:
        document = summary.to_json()
        if comparison is not None:  # the auto job's summary, with none's and the comparison beside it
            document |= {"baseline": comparison.baseline.to_json(), "comparison": comparison.to_json()}
        json_path.write_text(json.dumps(document, indent=2))
        console.print(f"summary written to {json_path}")
    if not summary.succeeded or (comparison is not None and not comparison.baseline.succeeded):
        raise typer.Exit(1)


def comparison_jobs(name: str, overrides: dict[str, Any]) -> tuple[ProgramJob, ProgramJob] | None:
    """(none, auto): the built-in job ``name`` twice, ``COMPARE_STEPS`` steps unless given; None for a
    job whose link carries nothing a codec may touch (ELECTRA's token ids, its sync tensor back)."""
    settings = {"steps": COMPARE_STEPS} | overrides
    baseline = _job(name, settings | {"edges.0.codec.forward": "none", "edges.0.codec.backward": "none"})
    if baseline.spec.edge.payload == "int64":
        return None
    backward = "none" if baseline.spec.pipeline.mode == "one_way" else "auto"
    candidate = _job(name, settings | {"edges.0.codec.forward": "auto", "edges.0.codec.backward": backward})
    return baseline, candidate


def _job(name: str, overrides: dict[str, Any]) -> ProgramJob:
    """The built-in job ``name`` with the demo's options; a bad option is a usage error (exit 2)."""
    from nebula_common.jobspec import SpecError, load_spec
    from nebula_common.jobspec.builtin import builtin_spec

    try:
        return ProgramJob(load_spec(builtin_spec(name), overrides))
    except (SpecError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from exc
