"""Benchmark: ABNet-cloud end to end on real Spanish->English text, BLEU per WAN codec.

Why: the paper's Table 5 compresses the encoder states (forward) and their
gradients (backward) of the ABNet-cloud fine-tuning and reports BLEU and time.
Here, on one local two-cluster deployment over the emulated WAN: (a) one
one_way Nebula job pre-trains the Spanish masked-LM encoder in cluster a (S) and
the English causal LM in cluster b (T), each on its own side of Django's
catalogues; (b) for each codec pair the fine-tuning job trains only the adapters
on top of the frozen pre-trained models (states S->T, gradients T->S); (c) the
same job then decodes the held-out split greedily across the clusters (states
sent once per batch, T decodes) and T scores BLEU with sacrebleu. Writes JSON
plus a Markdown report.

    .venv/bin/python bench/runtime/abnet_bleu.py --out bench-results/runtime
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from nebula_common.jobspec import load_spec
from nebula_common.jobspec.builtin import BUILTIN_DIR
from nebula_common.launcher import LocalDeployment
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.summary import JobSummary, summarize
from nebula_common.zoo.text_data import all_pairs, split_pairs

CODECS = (("none", "none"), ("fp16", "int8"), ("int8", "int8"))
JOB_DIR = BUILTIN_DIR / "abnet"


def login(deployment: LocalDeployment, cluster: str) -> ClusterSession:
    """A fresh account in ``cluster``, created by that cluster's own admin."""
    endpoints = deployment.endpoints(cluster)
    password = secrets.token_urlsafe(16)
    name = f"bench-abnet-{cluster}"
    with AuthClient(endpoints.auth) as auth:
        admin = auth.login("admin", deployment.cluster_state[cluster].admin_password)
        auth.create_account(admin.token, name, password)
    return ClusterSession.login(endpoints, name, password)


def stage_file(deployment: LocalDeployment, job: ProgramJob, stage: str, name: str) -> Path:
    cluster = job.clusters()[stage]
    found = sorted((deployment.run_dir / cluster).glob(f"**/jobs/{job.job_id}/{stage}/{name}"))
    if not found:
        raise RuntimeError(f"job {job.job_id}: no {name} of stage {stage} in cluster {cluster}")
    return found[0]


def run(job: ProgramJob, sessions: dict[str, ClusterSession]) -> tuple[JobSummary, float]:
    started = time.perf_counter()
    summary = summarize(job, submit_job(job, sessions))
    summary.fill_wan(sessions["a"], sessions["b"])
    if not summary.succeeded:
        raise RuntimeError(f"job {job.job_id} failed: {summary.stage_messages}")
    return summary, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pretrain-steps", type=int, default=600)
    parser.add_argument("--steps", type=int, default=800, help="Fine-tuning steps per codec.")
    parser.add_argument("--bandwidth-mbit", type=float, default=60.0)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=Path("bench-results") / "runtime")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    train, held = split_pairs(10)
    rows: list[dict[str, Any]] = []
    with LocalDeployment(
        run_dir=args.out / f"deployment-abnet-{time.strftime('%Y%m%d-%H%M%S')}",
        bandwidth_mbit=args.bandwidth_mbit,
        delay_ms=args.delay_ms,
    ) as deployment:
        sessions = {c: login(deployment, c) for c in ("a", "b")}
        pretrain = ProgramJob(load_spec(JOB_DIR / "pretrain.yaml", {"steps": args.pretrain_steps}))
        pre_summary, pre_seconds = run(pretrain, sessions)
        plm = {
            s: stage_file(deployment, pretrain, s, f"step-{args.pretrain_steps}/model.pt")
            for s in ("encoder", "decoder")
        }
        pre = {
            "seconds": pre_seconds,
            "decoder_lm_loss": [pre_summary.losses[0], pre_summary.losses[-1]],
            "encoder_mlm_loss": [
                pre_summary.local_losses["encoder"][0],
                pre_summary.local_losses["encoder"][-1],
            ],
        }
        print(json.dumps({"pretrain": pre}), flush=True)
        seen = {
            d: (pre_summary.wan[d]["bytes"], pre_summary.wan[d]["raw_bytes"]) for d in ("forward", "backward")
        }
        for forward, backward in CODECS:
            overrides = {
                "steps": args.steps,
                "edges.0.codec.forward": forward,
                "edges.0.codec.backward": backward,
                "stages.0.options.pretrained": str(plm["encoder"]),
                "stages.1.options.pretrained": str(plm["decoder"]),
            }
            job = ProgramJob(load_spec(JOB_DIR / "job.yaml", overrides))
            summary, wall = run(job, sessions)
            record = json.loads(stage_file(deployment, job, "decoder", "eval.json").read_text())
            # the switches count per link (cumulative over jobs): this job's bytes are the difference
            wan = {d: (summary.wan[d]["bytes"], summary.wan[d]["raw_bytes"]) for d in ("forward", "backward")}
            job_wan = {d: {"bytes": wan[d][0] - seen[d][0], "raw_bytes": wan[d][1] - seen[d][1]} for d in wan}
            seen = wan
            rows.append(
                {
                    "codec_forward": forward,
                    "codec_backward": backward,
                    "bleu": record["metrics"]["bleu"],
                    "chrf": record["metrics"]["chrf"],
                    "exact_match": record["metrics"]["exact_match"],
                    "loss_first": summary.losses[0],
                    "loss_last": summary.losses[-1],
                    "mean_step_ms": 1000 * summary.mean_step_seconds,
                    "train_seconds": summary.train_seconds,
                    "eval_seconds": record["eval_seconds"],
                    "wall_seconds": wall,
                    "wan": job_wan,
                    "samples": [
                        {"es": p.spanish, "en": p.english, "hypothesis": h}
                        for p, h in list(zip(held, record["outputs"], strict=True))[:8]
                    ],
                }
            )
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "samples"}), flush=True)
    report = {
        "cpus": os.cpu_count(),
        "bandwidth_mbit": args.bandwidth_mbit,
        "delay_ms": args.delay_ms,
        "pairs": {"total": len(all_pairs()), "train": len(train), "held_out": len(held)},
        "pretrain_steps": args.pretrain_steps,
        "finetune_steps": args.steps,
        "pretrain": pre,
        "rows": rows,
    }
    (args.out / "abnet_bleu.json").write_text(json.dumps(report, indent=2, ensure_ascii=False))
    lines = [
        "# ABNet-cloud Es->En on Django's catalogues: BLEU per WAN codec",
        "",
        f"WAN {args.bandwidth_mbit:g} Mbit/s, {args.delay_ms:g} ms one-way; {os.cpu_count()} CPUs shared by "
        f"every process. Pairs: {len(train)} train / {len(held)} held-out (short, plain, deduplicated). "
        f"Pre-training ({args.pretrain_steps} steps, one_way job): {pre_seconds:.0f} s, decoder LM loss "
        f"{pre['decoder_lm_loss'][0]:.2f} -> {pre['decoder_lm_loss'][1]:.2f}, encoder MLM loss "
        f"{pre['encoder_mlm_loss'][0]:.2f} -> {pre['encoder_mlm_loss'][1]:.2f}. Fine-tuning: {args.steps} "
        "steps, adapters only; evaluation: greedy decoding across the clusters, sacrebleu in T.",
        "",
        "| forward | backward | BLEU | chrF | loss first -> last | step ms | train s | eval s "
        "| fwd bytes | bwd bytes |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        wan = row["wan"]
        fwd, bwd = wan["forward"]["bytes"], wan["backward"]["bytes"]
        lines.append(
            f"| {row['codec_forward']} | {row['codec_backward']} | {row['bleu']:.2f} | {row['chrf']:.1f} | "
            f"{row['loss_first']:.3f} -> {row['loss_last']:.3f} | {row['mean_step_ms']:.0f} | "
            f"{row['train_seconds']:.0f} | {row['eval_seconds']:.1f} | {fwd:,} | {bwd:,} |"
        )
    lines += ["", "Held-out samples (codec none):", ""]
    lines += [f"- es: {s['es']} / ref: {s['en']} / hyp: {s['hypothesis']}" for s in rows[0]["samples"]]
    (args.out / "abnet_bleu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
