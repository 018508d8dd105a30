"""The job model the SDK submits: a loaded job spec, split into per-cluster stage specs."""

from __future__ import annotations

import hashlib
import json
import re
from typing import TYPE_CHECKING

from nebula_common.errors import InvalidRequestError
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.rpc.server import GRPC_MESSAGE_LIMIT

if TYPE_CHECKING:  # job specs (pydantic) and the reference run (torch): loaded by whoever builds a job
    from nebula_common.jobspec import LoadedJob
    from nebula_common.jobspec.reference import UnsplitResult

# A StageSpec travels in one AssignStage message; keep headroom below the 64 MiB gRPC limit for framing.
MAX_STAGE_SPEC_BYTES = GRPC_MESSAGE_LIMIT - 64 * 1024


class ProgramJob:
    """A user program job (YAML spec + one module per stage), ready to be split into stage specs.

    Each stage's spec carries only that stage's module source and options, so a
    cluster never receives, imports or holds another cluster's stage.
    """

    def __init__(
        self,
        loaded: LoadedJob,
        job_id: str | None = None,
        *,
        resume_job_id: str = "",
        resume_step: int = 0,
        initial_states: dict[str, bytes] | None = None,
        initial_step: int = 0,
    ) -> None:
        self.loaded = loaded
        self.spec = loaded.spec
        self.job_id = job_id or loaded.job_id()
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", self.job_id):
            raise ValueError(f"job_id {self.job_id!r} must be 1-128 chars of [A-Za-z0-9._-]")
        if resume_step > self.spec.steps:
            raise ValueError(f"resume_step {resume_step} is past the job's last step {self.spec.steps}")
        self.resume_job_id = resume_job_id
        self.resume_step = resume_step
        self.initial_states = dict(initial_states or {})
        self.initial_step = initial_step
        self.codec_forward = self.spec.edge.codec.forward
        self.codec_backward = self.spec.edge.codec.backward
        self.codec_choice = json.dumps({"source": "configured"})
        # A chain's later edges (edges.1..): their codecs as resolved (``auto`` replaced per edge).
        self.chained_codecs = [(edge.codec.forward, edge.codec.backward) for edge in self.spec.edges[1:]]
        if self.initial_states:
            self._check_hot_start()

    @classmethod
    def hot_started(
        cls, loaded: LoadedJob, steps: int, job_id: str | None = None
    ) -> tuple[ProgramJob, UnsplitResult]:
        """Train the first ``steps`` steps unsplit in this process, then a job that continues them split.

        The paper's Figure 8: a model pre-trained in one cluster is handed on to two.
        Each stage's spec carries only its own model, optimizer and scheduler state.
        """
        if not 1 <= steps < loaded.spec.steps:
            raise InvalidRequestError(
                f"hot start: {steps} unsplit steps must be in 1..{loaded.spec.steps - 1} "
                f"(the job has {loaded.spec.steps} steps and at least one must run split)"
            )
        from nebula_common.jobspec.reference import hot_start_states, run_unsplit  # torch, on demand

        result = run_unsplit(loaded, steps)
        return cls(loaded, job_id, initial_states=hot_start_states(result), initial_step=steps), result

    def _check_hot_start(self) -> None:
        """Refuse a hot start the trainers could not take, before anything is sent to either cluster."""
        names = [stage.name for stage in self.spec.stages]
        if sorted(self.initial_states) != sorted(names):
            raise InvalidRequestError(
                f"hot start: need the state of every stage ({', '.join(names)}), "
                f"got {', '.join(sorted(self.initial_states)) or 'none'}"
            )
        if self.resume_job_id:
            raise InvalidRequestError("hot start and resume are exclusive: a stage starts from one state")
        if not 1 <= self.initial_step < self.spec.steps:
            raise InvalidRequestError(
                f"hot start: initial_step {self.initial_step} must be in 1..{self.spec.steps - 1}"
            )
        for name in names:
            size = self.stage_spec(name).ByteSize()
            if size > MAX_STAGE_SPEC_BYTES:
                raise InvalidRequestError(
                    f"hot start: stage {name!r} spec with its initial state is {size:,} bytes; a stage "
                    f"spec must stay under {MAX_STAGE_SPEC_BYTES:,} bytes (the 64 MiB gRPC message limit "
                    "less framing): shrink the stage, or train it split from the start"
                )

    @property
    def start_step(self) -> int:
        """The first step the clusters run (after a resume or a hot start; 0 otherwise)."""
        return self.initial_step if self.initial_states else self.resume_step

    def set_codecs(self, forward: str, backward: str, choice_json: str) -> None:
        """Use these concrete codecs in every stage spec (how `auto` gets resolved before submission)."""
        self.codec_forward, self.codec_backward, self.codec_choice = forward, backward, choice_json

    def set_edge_codecs(self, codecs: list[tuple[str, str]], choice_json: str) -> None:
        """A chain's codecs, one (forward, backward) per edge in chain order, and the per-edge choice."""
        if len(codecs) != len(self.spec.edges):
            raise ValueError(f"{len(self.spec.edges)} edges need as many codec pairs, got {len(codecs)}")
        (self.codec_forward, self.codec_backward), *self.chained_codecs = codecs
        self.codec_choice = choice_json

    def edge_codecs(self) -> list[tuple[str, str]]:
        """(forward, backward) codec of every edge, in chain order, as the stages run them."""
        return [(self.codec_forward, self.codec_backward), *self.chained_codecs]

    @property
    def steps(self) -> int:
        return self.spec.steps

    def settings(self) -> dict[str, object]:
        """What the job ran with, for its summary and report (after ``auto`` codecs were resolved)."""
        return {
            "spec": str(self.loaded.spec_path) if self.loaded.spec_path else None,
            "schedule": self.spec.pipeline.schedule,
            "mode": self.spec.pipeline.mode,
            "replicas": {stage.name: stage.replicas for stage in self.spec.stages},
            "micro_batches": self.spec.data.micro_batches,
            "batch_size": self.spec.data.batch_size,
            "codec_forward": self.codec_forward,
            "codec_backward": self.codec_backward,
            "codec_choice": json.loads(self.codec_choice),
            **(
                {
                    "edge_codecs": {
                        e.name: list(c) for e, c in zip(self.spec.edges, self.edge_codecs(), strict=True)
                    }
                }
                if len(self.spec.edges) > 1
                else {}
            ),
            "resumed_from": f"{self.resume_job_id}@{self.resume_step}" if self.resume_job_id else None,
            "hot_start_steps": self.initial_step if self.initial_states else None,
        }

    @property
    def spec_digest(self) -> str:
        """SHA-256 of what the job runs: the validated spec, every stage module and the concrete codecs.

        Both clusters get the same digest, so a job's record can be matched across clusters and a
        re-submission of a changed spec under a reused id told apart. Computed after ``auto`` codecs
        are resolved: the digest names the codecs that actually run.
        """
        body = {
            "spec": self.spec.model_dump(mode="json"),
            "modules": {name: module.source for name, module in sorted(self.loaded.modules.items())},
            "codecs": [self.codec_forward, self.codec_backward],
            **({"chained_codecs": self.chained_codecs} if self.chained_codecs else {}),
            "resume": [self.resume_job_id, self.resume_step],
            "hot_start": {
                name: hashlib.sha256(state).hexdigest() for name, state in sorted(self.initial_states.items())
            },
        }
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()

    def _edge_codecs(self, index: int) -> tuple[str, str]:
        """Forward and backward codec of ``edges.<index>`` as resolved (``auto`` replaced by its advice)."""
        return self.edge_codecs()[index]

    @property
    def edge(self) -> str:
        return self.spec.edge.name

    def clusters(self) -> dict[str, str]:
        """Stage name -> cluster id, upstream first."""
        return {stage.name: stage.cluster for stage in self.spec.stages}

    def stage_spec(self, stage_name: str) -> trainer_pb2.StageSpec:
        from nebula_common.jobspec.spec import stage_role

        spec = self.spec
        index = next((i for i, s in enumerate(spec.stages) if s.name == stage_name), None)
        if index is None:
            raise ValueError(f"no stage {stage_name!r} in job {spec.name!r}")
        stage = spec.stages[index]
        module = self.loaded.modules[stage.name]
        count = len(spec.stages)
        # A stage's `edge` is the one it receives activations on (the first stage: the one it sends on).
        edge_index = max(index - 1, 0)
        forward, backward = self._edge_codecs(edge_index)
        peer = spec.stages[index + 1 if index == 0 else index - 1].cluster
        downstream_edge = None
        if 0 < index < count - 1:  # a middle stage of a chain also sends on edges.<index>
            down_forward, down_backward = self._edge_codecs(index)
            downstream_edge = trainer_pb2.ChainEdge(
                edge=spec.edges[index].name,
                codec_forward=down_forward,
                codec_backward=down_backward,
                peer_cluster=spec.stages[index + 1].cluster,
            )
        return trainer_pb2.StageSpec(
            job_id=self.job_id,
            stage=stage.name,
            edge=spec.edges[edge_index].name,
            steps=spec.steps,
            codec_forward=forward,
            codec_backward=backward,
            codec_choice=self.codec_choice,
            spec_digest=self.spec_digest,
            peer_cluster=peer,
            downstream_edge=downstream_edge,
            program=trainer_pb2.ProgramStage(
                role=stage_role(index, count),
                stage_count=count if count > 2 else 0,
                module_source=module.source,
                module_name=module.path.name,
                options_json=json.dumps(stage.options),
                batch_size=spec.data.batch_size,
                micro_batches=spec.data.micro_batches,
                num_examples=spec.data.examples,
                schedule=spec.pipeline.schedule,
                max_in_flight=spec.pipeline.max_in_flight,
                seed=spec.seed,
                stage_index=index,
                optimizer=trainer_pb2.OptimizerConfig(
                    name=spec.optimizer.name,
                    learning_rate=spec.optimizer.lr,
                    weight_decay=spec.optimizer.weight_decay,
                    momentum=spec.optimizer.momentum,
                    lr_schedule=spec.lr_schedule.name,
                    warmup_steps=spec.lr_schedule.warmup_steps,
                ),
                checkpoint_interval=spec.checkpoint.interval,
                resume_job_id=self.resume_job_id,
                resume_step=self.resume_step,
                mode=spec.pipeline.mode,
                sync_lag=spec.pipeline.sync_lag,
                replicas=stage.replicas,
                parallel=stage.parallel,
                shard_size=stage.shard_size or 0,
                dataset=stage.dataset or "",
                payload=spec.edges[edge_index].payload,
                initial_state=self.initial_states.get(stage.name, b""),
                initial_step=self.initial_step if self.initial_states else 0,
            ),
        )
