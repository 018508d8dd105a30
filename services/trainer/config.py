"""Trainer settings from NEBULA_TRAINER_* environment variables."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from nebula_common.rpc.edge_tls import edge_address
from nebula_common.service.settings import AuditedServiceSettings, HostPort
from services.trainer.rank_accounts import RankAccounts


class TrainerSettings(AuditedServiceSettings):
    """One cluster's compute: where it listens and which of its cluster's services it uses."""

    model_config = SettingsConfigDict(env_prefix="NEBULA_TRAINER_")
    listen: HostPort = Field("127.0.0.1:0", description="Cluster-internal control port (SDK -> trainer).")
    switch_address: HostPort = Field(description="host:port of this cluster's switch internal port.")
    switch_edge_socket: str = Field(
        "",
        description="This cluster's switch edge socket (the switch's NEBULA_SWITCH_EDGE_SOCKET): a path "
        "(with a '/') on this host, or host:port of its TCP edge port (mutual TLS 1.3 with this trainer's "
        "internal identity, then sealed records). Each stage process then carries its edges as records on a "
        "connection the trainer makes there with a one-time ticket and passes to it "
        "(services/trainer/stage_edge_fds.py), instead of gRPC through its proxy. A missing or refusing "
        "socket is retried naming why, never replaced by gRPC. Empty: gRPC edges through the stage's proxy "
        "(stages on cluster ranks always use gRPC).",
    )
    auth_address: HostPort = Field(description="host:port of this cluster's auth service.")
    torch_threads: int = Field(1, ge=1, le=256, description="Intra-op threads for torch on this trainer.")
    data_dir: Path | None = Field(
        None, description="Where stage checkpoints go (default: <tmp>/nebula-trainer-<cluster_id>)."
    )
    data_service_address: HostPort | None = Field(
        None, description="host:port of this cluster's data service (stages that train on granted datasets)."
    )
    edge_max_outage_s: float = Field(
        300.0,
        gt=0,
        description="How long a job edge waits for a lost WAN link (or its switch) to come back before the "
        "stage fails; shorter outages only pause training.",
    )
    edge_window_bytes: int = Field(
        16 << 20,
        ge=1 << 20,
        description="Receive window per job edge (bytes beyond what it holds; the switch may cap it lower).",
    )
    finished_ttl_s: float = Field(
        3600.0,
        gt=0,
        description="How long a finished stage stays known (WatchStage shows its final status; its id "
        "stays taken); after it the trainer forgets the stage.",
    )
    max_finished: int = Field(
        1000, ge=1, description="Finished stages kept at most (the oldest are forgotten first)."
    )
    max_recoveries: int = Field(
        20,
        ge=0,
        description="How many times a stage may restart from the last common checkpoint (its trainer or the "
        "other cluster's restarted, or an outage passed edge_max_outage_s) before it fails.",
    )
    receive_ahead: int | None = Field(
        None,
        ge=0,
        description="How many received items a stage's receive thread decodes ahead of its compute "
        "(default: max(2, the job's max_in_flight)); 0 receives and decodes on the stage thread, the "
        "serial path (for measuring what the overlap gains; training is bit-identical either way).",
    )
    ranks_listen: HostPort | None = Field(
        None,
        description="host:port of the rank store this trainer hosts for its cluster's rank processes "
        "(python -m services.trainer.worker, started with torchrun or one per container/pod; each sets "
        "NEBULA_WORKER_TRAINER to this address). With it, every data-parallel-capable stage runs on those "
        "ranks, whatever its replicas; only this trainer talks to the switch. Needs ranks.",
    )
    ranks: int | None = Field(
        None, ge=1, le=64, description="How many rank processes join ranks_listen (their WORLD_SIZE)."
    )
    ranks_accounts: str = Field(
        "*",
        description="Comma-separated accounts whose stages compute on ranks_listen's ranks (one stage at a "
        "time): exact names, prefixes ending in '*' (team-*), or '*' for every account (the default). Such "
        "a stage's driver runs in its stage box on this trainer and each worker boxes its part; every other "
        "account's stage computes in its stage box on this trainer alone. Empty: no account.",
    )

    @field_validator("switch_edge_socket")
    @classmethod
    def _edge_socket(cls, value: str) -> str:
        if value:
            edge_address(value, "NEBULA_TRAINER_SWITCH_EDGE_SOCKET")  # a value of neither form, named
        return value

    @field_validator("ranks_accounts")
    @classmethod
    def _accounts(cls, value: str) -> str:
        RankAccounts.parse(value)  # a bad entry is named at start-up
        return value

    stage_isolation: Literal["auto", "bwrap", "landlock", "process"] = Field(
        "auto",
        description="How stages are confined: 'bwrap' (bubblewrap namespaces: no network, no view of the "
        "host beyond the stage's code and its account's files; start-up fails if unavailable), "
        "'landlock' (the kernel's Landlock, for containers: reads only its code and account, no TCP, "
        "no signal or ptrace outside; start-up fails if unavailable), 'process' (a separate process as "
        "the trainer's user), 'auto' (the first of bwrap, landlock, process that works here, with a "
        "warning naming why when it is not bwrap). A stage on the cluster's ranks (ranks_accounts) is "
        "driven from such a box that keeps TCP to its ranks (to the host's ephemeral ports only where "
        "Landlock has TCP rules), each rank's part boxed by its worker.",
    )
    stage_memory_mb: int = Field(
        8192, ge=256, description="Address-space limit of each stage process (MiB; RLIMIT_AS)."
    )
    stage_cpu_seconds: int = Field(
        30 * 24 * 3600, ge=10, description="CPU time limit of each stage process (seconds; RLIMIT_CPU)."
    )
    stage_max_processes: int = Field(
        512,
        ge=16,
        description="Processes and threads of each stage together (its control group's pids.max, where "
        "the trainer can make control groups).",
    )
    stage_open_files: int = Field(
        4096, ge=64, le=1 << 20, description="Open files limit of each stage process (RLIMIT_NOFILE)."
    )
    stage_cgroup: str = Field(
        "nebula-stages",
        pattern=r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$",
        description="The control-group folder stage groups are made in: under each v1 controller's root, "
        "or under the trainer's own group (v2). nebula local up delegates one folder per trainer, owned "
        "by the trainer's user, since its boxed trainer may not write elsewhere in /sys/fs/cgroup.",
    )
    stop_grace_s: float = Field(
        10.0, gt=0, description="On stop, how long running stages get to end before the process exits."
    )

    @model_validator(mode="after")
    def _ranks_together(self) -> TrainerSettings:
        if (self.ranks_listen is None) != (self.ranks is None):
            raise ValueError(
                "NEBULA_TRAINER_RANKS_LISTEN and NEBULA_TRAINER_RANKS go together (set both or neither)"
            )
        return self

    def resolved_data_dir(self) -> Path:
        return self.data_dir or Path(tempfile.gettempdir()) / f"nebula-trainer-{self.cluster_id}"
