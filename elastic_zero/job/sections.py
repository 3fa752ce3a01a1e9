"""The job spec's sections: one frozen dataclass per TOML table, each with its own validation.
`spec.py` puts them together (JobSpec) and loads them from TOML, a dict or `--set`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Optional, Union


class SpecError(ValueError):
    pass


def _fail(where: str, what: str) -> None:
    raise SpecError(f"{where}: {what}")


def _choice(where: str, value, allowed) -> None:
    if value not in allowed:
        _fail(where, f"got {value!r}; allowed: {', '.join(repr(a) for a in allowed)}")


def _at_least(where: str, value, low) -> None:
    if value is not None and value < low:
        _fail(where, f"must be >= {low}, got {value!r}")


# A user's function: "package.module:function" (imported where it runs) or, from Python, the
# callable itself (Ray pickles it).
Ref = Union[str, Callable]


def _check_ref(where: str, value) -> None:
    if value is None or callable(value):
        return
    if not isinstance(value, str) or value.count(":") != 1 or not all(value.split(":")):
        _fail(where, f"must look like 'package.module:function' (or be a callable), got {value!r}")


DEFAULT_PRESET = "gpt-tiny"  # what a spec with neither preset nor factory trains
DEFAULT_STEPS = 40  # what a spec with neither steps nor epochs trains


@dataclass(frozen=True)
class ModelSpec:
    preset: Optional[str] = None  # a built-in model, "gpt-small" or "gpt-tiny" (with no factory either: "gpt-tiny")
    factory: Optional[Ref] = None  # returns an nn.Module, called with `kwargs`
    kwargs: dict = field(default_factory=dict)  # the preset's or the factory's keyword arguments (e.g. vocab_size, d_model)
    wrap: list = field(default_factory=list)  # class names of the units (default: each child of a ModuleList)
    init_from: Optional[str] = None  # weights loaded before step 0: a safetensors file, a Hugging Face model directory, a torch.save'd state dict or one of our checkpoints (a path or URI; safetensors, checkpoints and a local torch.save'd file are read a tensor at a time as they are needed, a remote torch.save'd file whole)
    new_params: list = field(default_factory=list)  # glob patterns of parameters init_from need not hold (adapters, a new head): they keep the factory's initialization

    def validate(self) -> None:
        from elastic_zero.models.presets import PRESETS

        if self.preset is not None and self.factory is not None:
            _fail("model", "give one of 'preset' and 'factory', not both")
        if self.preset is not None:
            _choice("model.preset", self.preset, sorted(PRESETS))
        _check_ref("model.factory", self.factory)
        if not all(isinstance(w, str) and w for w in self.wrap):
            _fail("model.wrap", f"must be a list of module class names, got {self.wrap!r}")
        if self.init_from is not None and not self.init_from:
            _fail("model.init_from", "must be a path or URI")
        if not all(isinstance(p, str) and p for p in self.new_params):
            _fail("model.new_params", f"must be a list of parameter-name patterns, got {self.new_params!r}")
        if self.new_params and not self.init_from:
            _fail("model.new_params", "applies only with model.init_from (without it, every parameter is new)")


@dataclass(frozen=True)
class DataSpec:
    source: str = "synthetic"  # "synthetic", or a path / URI of an Arrow or Parquet dataset (a file or a directory)
    column: str = "tokens"  # the default collate's column of token-id lists
    columns: Optional[list] = None  # the columns read (default: `column`, or every column for a collate)
    collate: Optional[Ref] = None  # fn(pyarrow.Table) -> dict of tensors (default: token_collate)
    seq_len: Optional[int] = None  # tokens a sample is padded/cut to (default: what the model says)
    vocab_size: Optional[int] = None  # synthetic data, when the model does not say
    pad_id: int = 0  # what the default collate pads ragged samples with
    branching: int = 4  # synthetic: successors per token

    def validate(self) -> None:
        if not self.source:
            _fail("data.source", "must be 'synthetic' or a path/URI to Arrow/Parquet data")
        if not self.column:
            _fail("data.column", "must name a column")
        if self.columns is not None and (not self.columns or not all(isinstance(c, str) and c for c in self.columns)):
            _fail("data.columns", f"must be a non-empty list of column names, got {self.columns!r}")
        _check_ref("data.collate", self.collate)
        if self.collate is not None and self.source == "synthetic":
            _fail("data.collate", "applies to Arrow/Parquet data; 'synthetic' makes its batches itself")
        _at_least("data.seq_len", self.seq_len, 1)
        _at_least("data.vocab_size", self.vocab_size, 2)
        _at_least("data.pad_id", self.pad_id, 0)
        _at_least("data.branching", self.branching, 1)

    def columns_read(self, own_collate: bool) -> Optional[list]:
        """The columns a worker reads: `columns`, else the default collate's `column`, else (with a
        collate of the user's) all of them (None)."""
        return self.columns or (None if own_collate else [self.column])


@dataclass(frozen=True)
class TrainSpec:
    steps: Optional[int] = None  # optimizer steps to train (with no epochs either: 40)
    epochs: Optional[int] = None  # instead of steps: passes over a finite dataset (resolved to steps at submit)
    global_batch: int = 16  # samples per optimizer step, whatever the number of workers
    micro_batch: int = 4  # samples per forward/backward on a worker (gradient accumulation up to its share)
    seed: int = 0  # the sample order and the synthetic data
    grad_clip: Optional[float] = 1.0  # global gradient norm clipping (absent: none)
    loss: Optional[Ref] = None  # fn(model, batch) -> scalar or {"loss": scalar, metric: scalar} (default: next_token_loss)

    def validate(self) -> None:
        if self.steps is not None and self.epochs is not None:
            _fail("train.epochs", "give one of 'steps' and 'epochs', not both")
        _at_least("train.steps", self.steps, 1)
        _at_least("train.epochs", self.epochs, 1)
        _check_ref("train.loss", self.loss)
        _at_least("train.global_batch", self.global_batch, 1)
        _at_least("train.micro_batch", self.micro_batch, 1)
        _at_least("train.seed", self.seed, 0)
        if self.grad_clip is not None and self.grad_clip <= 0:
            _fail("train.grad_clip", f"must be > 0 (or absent), got {self.grad_clip!r}")


@dataclass(frozen=True)
class EvalSpec:
    source: Optional[str] = None  # held-out data read like data.source ("synthetic": walks of the chain training never reaches); absent: no evaluation
    every: int = 100  # steps between evaluations; also at step 0 and after the last step
    batches: Optional[int] = None  # batches of train.global_batch samples evaluated (absent: the whole set; synthetic needs it)
    loss: Optional[Ref] = None  # fn(model, batch) like train.loss (default: the training loss)

    def validate(self) -> None:
        if self.source is not None and not self.source:
            _fail("eval.source", "must be 'synthetic' or a path/URI to Arrow/Parquet data")
        _at_least("eval.every", self.every, 1)
        _at_least("eval.batches", self.batches, 1)
        _check_ref("eval.loss", self.loss)
        if self.source == "synthetic" and self.batches is None:
            _fail("eval.batches", "is required for synthetic data, which has no end")


@dataclass(frozen=True)
class OptimizerSpec:
    name: str = "adamw"  # "adamw" or "sgd"
    lr: float = 1e-3  # the peak learning rate
    weight_decay: float = 0.0  # the optimizer's weight decay
    betas: list = field(default_factory=lambda: [0.9, 0.95])  # Adam's two moment decays, each in [0, 1)
    eps: float = 1e-8  # Adam's denominator term, > 0
    momentum: float = 0.0  # SGD, in [0, 1)
    schedule: str = "constant"  # "constant" or "warmup_cosine"
    warmup_steps: int = 0  # linear warm-up from 0 to lr

    def validate(self) -> None:
        _choice("optimizer.name", self.name, ["adamw", "sgd"])
        _choice("optimizer.schedule", self.schedule, ["constant", "warmup_cosine"])
        _at_least("optimizer.lr", self.lr, 0.0)
        _at_least("optimizer.weight_decay", self.weight_decay, 0.0)
        _at_least("optimizer.warmup_steps", self.warmup_steps, 0)
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas):
            _fail("optimizer.betas", f"must be two numbers in [0, 1), got {self.betas!r}")
        if not 0 <= self.momentum < 1:
            _fail("optimizer.momentum", f"must be in [0, 1), got {self.momentum!r}")
        if self.eps <= 0:
            _fail("optimizer.eps", f"must be > 0, got {self.eps!r}")


@dataclass(frozen=True)
class ZeroSpec:
    stage: int = 2  # ZeRO stage: 1 shards the optimizer state, 2 the gradients too, 3 the parameters too
    compute_dtype: str = "float32"  # the forward and backward dtype: "float32", "bfloat16" or "float16"

    def validate(self) -> None:
        _choice("zero.stage", self.stage, [1, 2, 3])
        _choice("zero.compute_dtype", self.compute_dtype, ["float32", "bfloat16", "float16"])


HEARTBEAT_EVERY_S = 0.1  # how often a worker tells the coordinator it is alive


WORKER_RESOURCES_SET_BY_THE_JOB = ("CPU", "GPU", "memory", "object_store_memory")


@dataclass(frozen=True)
class ElasticSpec:
    workers: int = 2  # the workers the job starts with and tops back up to
    min_workers: int = 1  # below it training waits (min_wait_s) for replacements, then fails
    max_workers: int = 4  # the most `scale` may ask for; at most global_batch
    standby_workers: int = 0  # workers kept started and ready beside the job's (each on a device of its own): a lost worker is replaced from them at once, not after a worker's start, and they are topped back up (one that dies while it waits too, at once); one whose node, as measured, has no room for it beside the job's workers is retired with a warning, and asked for again when every node of the job's workers has room for it and a quarter more (up to three retirements)
    replicate_every: Union[int, str] = "auto"  # steps between buddy replicas (every safe point replicates too); "auto": the most frequent cadence whose copies take at most 5% of the steps' time, measured in each generation; 0: none, a lost worker is recovered from the latest checkpoint (with none committed: the job starts over from its initial weights)
    use_gpu: bool = False  # one GPU per worker and NCCL, else one CPU and gloo
    collective_timeout_s: float = 30.0  # a collective waiting longer fails the generation; its hung member is killed
    min_wait_s: float = 60.0  # how long to wait for workers while below min_workers
    coordinator_wait_s: float = 60.0  # how long workers whose coordinator was lost wait, stopped at a safe point, for its replacement to take them over and train on from their memory; then they end, and the job resumes from its latest checkpoint (0: they end at once)
    heartbeat_timeout_s: float = 1.0  # a member silent this long, while others are heard, is lost (0: off)
    stuck_after_steps: float = 3.0  # a member that did not move for this many measured steps (at least stuck_min_s) while its peers went on past it is stuck: killed, and recovered as a loss (0: off; plan/stuck.py)
    stuck_min_s: float = 2.0  # the least time a member behind its peers may stay put before it is stuck
    join_window_s: float = 5.0  # a ready joiner waits this long at most for workers still starting, to join with them
    memory_per_node_gib: Optional[float] = None  # the most the job's workers on one node may hold together (default: as much as Ray's memory monitor allows, less what else runs there)
    worker_labels: dict = field(default_factory=dict)  # Ray node labels a worker's node must have, as a label selector (e.g. {"ray.io/market-type" = "spot"}); an autoscaler sees them in a pending worker's demand and starts a node of a type that has them
    worker_resources: dict = field(default_factory=dict)  # custom Ray resources each worker asks for beside its CPU or GPU (e.g. {spot = 1}): what a node type must offer to host one

    def validate(self) -> None:
        _at_least("elastic.min_workers", self.min_workers, 1)
        _at_least("elastic.standby_workers", self.standby_workers, 0)
        if self.memory_per_node_gib is not None and not self.memory_per_node_gib > 0:
            _fail("elastic.memory_per_node_gib", f"must be > 0 (or unset), got {self.memory_per_node_gib!r}")
        _at_least("elastic.join_window_s", self.join_window_s, 0.0)
        for key, value in self.worker_labels.items():
            if not isinstance(value, str) or not key or not value:
                _fail(f"elastic.worker_labels.{key}", f"must be a non-empty label value (a string), got {value!r}")
        for name, amount in self.worker_resources.items():
            if name in WORKER_RESOURCES_SET_BY_THE_JOB:
                _fail(f"elastic.worker_resources.{name}", "is set by the job (one CPU, or one GPU with use_gpu)")
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
                _fail(f"elastic.worker_resources.{name}", f"must be a number > 0, got {amount!r}")
        if self.replicate_every != "auto" and (isinstance(self.replicate_every, str) or self.replicate_every < 0):
            _fail("elastic.replicate_every", f"must be an integer >= 0 or \"auto\", got {self.replicate_every!r}")
        if not self.min_workers <= self.workers <= self.max_workers:
            _fail("elastic.workers", f"must lie in [min_workers, max_workers] = "
                                     f"[{self.min_workers}, {self.max_workers}], got {self.workers}")
        if self.collective_timeout_s <= 0:
            _fail("elastic.collective_timeout_s", f"must be > 0, got {self.collective_timeout_s!r}")
        _at_least("elastic.min_wait_s", self.min_wait_s, 0.0)
        _at_least("elastic.heartbeat_timeout_s", self.heartbeat_timeout_s, 0.0)
        _at_least("elastic.stuck_after_steps", self.stuck_after_steps, 0.0)
        _at_least("elastic.stuck_min_s", self.stuck_min_s, 0.0)
        _at_least("elastic.coordinator_wait_s", self.coordinator_wait_s, 0.0)
        if 0 < self.heartbeat_timeout_s < 4 * HEARTBEAT_EVERY_S:
            _fail("elastic.heartbeat_timeout_s", f"must be 0 (off) or >= {4 * HEARTBEAT_EVERY_S:g} (4 heartbeats), "
                                                 f"got {self.heartbeat_timeout_s!r}")


def scale_refusal(workers: int, min_workers: int, max_workers: int) -> str | None:
    """Why `scale` to `workers` is refused, None where it is not: the coordinator's rule, which a client
    also checks against the job's published status before it asks the coordinator (a control job)."""
    if not min_workers <= workers <= max_workers:
        return f"scale to {workers}: outside [min_workers, max_workers] = [{min_workers}, {max_workers}]"
    return None


@dataclass(frozen=True)
class CheckpointSpec:
    uri: Optional[str] = None  # a directory or URI pyarrow.fs can write (a path, file://, s3://, gs://); default: the run directory's checkpoints/, for the final weights
    every: int = 0  # steps between checkpoints, saved asynchronously (0: only the final weights' and a stop's); one due while the last is still being written is skipped (the step never waits for the store)
    keep: int = 3  # the newest commits kept
    resume: Optional[str] = None  # "latest", a step number or a step directory: start from that checkpoint

    def validate(self) -> None:
        _at_least("checkpoint.every", self.every, 0)
        _at_least("checkpoint.keep", self.keep, 1)
        if (self.every or self.resume) and not self.uri:
            _fail("checkpoint.uri", "is required when 'every' or 'resume' is set")
        if self.resume is not None and not re.fullmatch(r"latest|\d+|step-\d{10}(-\d+)?", self.resume):
            _fail("checkpoint.resume", f"must be 'latest', a step number or a step directory name, got {self.resume!r}")


TRACKING_BACKENDS = ("mlflow", "tensorboard")


@dataclass(frozen=True)
class TrackingSpec:
    backends: list = field(default_factory=list)  # "mlflow" and/or "tensorboard", each an optional extra (pip install 'elastic-zero[mlflow]')
    mlflow_uri: Optional[str] = None  # MLflow's tracking URI (default: the file store ./mlruns where the job is launched)
    experiment: Optional[str] = None  # the MLflow experiment (default: the job's name)
    tensorboard_dir: Optional[str] = None  # TensorBoard's log directory (default: the run directory's tensorboard/)

    def validate(self) -> None:
        if not isinstance(self.backends, list):
            _fail("tracking.backends", f"must be a list, got {self.backends!r}")
        for i, backend in enumerate(self.backends):
            _choice(f"tracking.backends[{i}]", backend, TRACKING_BACKENDS)
        if len(set(self.backends)) != len(self.backends):
            _fail("tracking.backends", f"names a backend twice: {self.backends!r}")
        for name in ("mlflow_uri", "experiment", "tensorboard_dir"):
            if getattr(self, name) is not None and not getattr(self, name):
                _fail(f"tracking.{name}", "must not be empty (leave it out for the default)")


WATCH_SOURCES = ("sigterm", "ray-drain", "aws", "gcp", "azure")


@dataclass(frozen=True)
class PreemptionSpec:
    watch: list = field(default_factory=lambda: list(WATCH_SOURCES))  # the sources of notices; which of the clouds a node is on is found out there
    poll_s: float = 1.0  # how often the metadata servers and Ray's drains are asked
    sigterm_grace_s: float = 30.0  # a SIGTERM'd worker goes this long after (ELASTIC_ZERO_TERMINATION_GRACE_S)
    aws_endpoint: str = "http://169.254.169.254"  # the EC2 instance metadata service (IMDSv2)
    gcp_endpoint: str = "http://169.254.169.254"  # metadata.google.internal without a DNS lookup that may hang
    azure_endpoint: str = "http://169.254.169.254"  # Azure's instance metadata service (Scheduled Events)

    def validate(self) -> None:
        if not isinstance(self.watch, list):
            _fail("preemption.watch", f"must be a list, got {self.watch!r}")
        for i, source in enumerate(self.watch):
            _choice(f"preemption.watch[{i}]", source, WATCH_SOURCES)
        if self.poll_s <= 0:
            _fail("preemption.poll_s", f"must be > 0, got {self.poll_s!r}")
        _at_least("preemption.sigterm_grace_s", self.sigterm_grace_s, 0.0)
        for name in ("aws_endpoint", "gcp_endpoint", "azure_endpoint"):
            if not re.fullmatch(r"https?://[^\s/]+", getattr(self, name)):
                _fail(f"preemption.{name}", f"must be http(s)://HOST[:PORT], got {getattr(self, name)!r}")

    def endpoints(self) -> dict:
        return {"aws": self.aws_endpoint, "gcp": self.gcp_endpoint, "azure": self.azure_endpoint}

    def clouds(self) -> list:
        """The watched sources that are clouds, in the order they are tried."""
        return [source for source in self.watch if source in ("aws", "gcp", "azure")]


# the worker's process exits ("device_error": a CUDA error is raised in the step, which ends it)
KILL_ACTIONS = ("kill", "kill_after_save", "kill_in_handover", "kill_after_handover", "kill_in_final_save",
                "kill_in_eval", "device_error")
# alive but not training: before the step, inside its data read, or before the step's second collective
# (its peers already inside it)
HANG_ACTIONS = ("hang", "hang_in_data", "hang_in_collective")


@dataclass(frozen=True)
class FaultSpec:
    at_step: int  # the step it happens at (for the handover and final-save drills: from it on)
    action: str  # one of KILL_ACTIONS, HANG_ACTIONS, "raise", "preempt", "scale" or "kill_coordinator" (the rank kills the job's coordinator before the step)
    rank: Optional[int] = None  # the rank it hits, in the generation of the moment
    workers: Optional[int] = None  # scale: the world size asked for
    deadline_s: Optional[float] = None  # preempt: seconds until the worker goes

    def validate(self, where: str) -> None:
        _at_least(f"{where}.at_step", self.at_step, 0)
        _choice(f"{where}.action", self.action, [*KILL_ACTIONS, *HANG_ACTIONS, "raise", "preempt", "scale",
                                                 "kill_coordinator"])
        if self.action != "scale" and self.rank is None:
            _fail(f"{where}.rank", f"is required for action {self.action!r}")
        _at_least(f"{where}.rank", self.rank, 0)
        if self.action == "scale" and self.workers is None:
            _fail(f"{where}.workers", "is required for action 'scale'")
        _at_least(f"{where}.workers", self.workers, 1)
        _at_least(f"{where}.deadline_s", self.deadline_s, 0.0)
