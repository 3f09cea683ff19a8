"""The sections of a job file: resources, trainer (with its parallel degrees), command, checkpoint,
budget, teardown, recovery.

Pydantic v2 models with ``extra="forbid"`` at every level (a typo is an error, not a silent
default) and a docstring per field (they become the JSON schema's descriptions: ``dtrun
schema``). ``plan/spec.py`` joins them into the job (``JobSpec``), checks them against each other
and loads them from YAML. Imports nothing heavy: the trainer reads these too.
"""

from __future__ import annotations

import re
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from orchestrator.contract.gpus import GPUS, canonical_gpu
from orchestrator.plan.presets import ModelSpec, resolve_model

PROVIDERS = ("runpod", "lambda", "vast", "modal", "local", "fake")
DEFAULT_NODE_IMAGE = "pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime"
"""``resources.image: default``: the official PyTorch image of the pinned torch (pyproject's
``torch==2.13.0``; tag scheme ``<torch>-cuda<X.Y>-cudnn<N>-runtime`` of hub.docker.com/r/pytorch/pytorch).
Keep it in step with the pin: tests/orchestrator/test_startup_and_images.py checks it."""
ProviderName = Literal["runpod", "lambda", "vast", "modal", "local", "fake"]


class _Model(BaseModel):
    # The docstring under each field is its documentation; `dtrun schema` reads it (field_docs),
    # not pydantic at class creation (use_attribute_docstrings parses every class's source: ~20 ms
    # of each dry run, for a schema only `dtrun schema` prints).
    model_config = ConfigDict(extra="forbid", validate_default=True)


class Resources(_Model):
    """Where the job runs and on what."""

    providers: list[ProviderName] = Field(default_factory=lambda: ["local"], min_length=1)
    """Providers to rent from, in no particular order (offers are ranked by price)."""
    gpu: str = "cpu"
    """GPU type: H100, H200, A100-80GB, A100, L40S, L4, A10, RTX4090, T4, GH200, B200, or cpu
    (the local provider: each rank is a CPU process)."""
    gpus_per_node: int = Field(1, gt=0, le=16)
    """GPUs (ranks) on each node."""
    nodes: int = Field(1, gt=0, le=64)
    """Nodes in the job."""
    spot: Union[bool, Literal["prefer"]] = False
    """Spot/interruptible capacity: true (only spot), false (only on-demand), or prefer
    (both, ranked by price; spot counted with its expected preemption overhead)."""
    regions: list[str] = Field(default_factory=list)
    """Allowed regions (empty: any)."""
    max_price_per_gpu_hour: float | None = Field(None, gt=0)
    """Refuse offers above this price (USD per GPU-hour)."""
    preemptions_per_hour: float | None = Field(None, ge=0)
    """Spot preemptions per hour of one node the estimate assumes (default 0.2; `dtrun simulate`
    explores others). With several nodes, losing any one ends the whole attempt: N × this rate."""
    cpu_per_gpu: float = Field(8.0, gt=0, le=64)
    """Physical CPU cores requested per GPU where the provider sizes the container (Modal; data
    loading and the host side of each rank). Instance providers give the instance's own cores."""
    memory_gb_per_gpu: float = Field(48.0, gt=0, le=1024)
    """Host memory (GiB) requested per GPU where the provider sizes the container (Modal; pinned
    buffers, the data loader, checkpoint staging). Instance providers give the instance's memory."""
    image: str = "default"
    """Container image with Python and torch preinstalled for nodes that run one (RunPod and Vast:
    SkyPilot ``image_id: docker:<image>``; Modal: the sandbox's base image). ``default``: the
    official PyTorch image matching the pinned torch (on Modal: Modal's own cached layered build);
    ``none``: the provider's bare image, and every start installs torch (slow). Lambda runs its VM image's PyTorch either way; the node's setup
    step installs only what is missing."""

    @field_validator("gpu")
    @classmethod
    def _gpu(cls, v: str) -> str:
        c = canonical_gpu(v)
        if c is None:
            raise ValueError(f"unknown GPU {v!r}; known: {', '.join(GPUS)}")
        return c

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.nodes


class Parallel(_Model):
    """Parallel degrees. pp × dp_replicate × dp_shard × cp × tp = GPUs in the job; ep divides dp_shard × tp."""

    dp_replicate: int = Field(1, gt=0)
    """HSDP: replicas of the FSDP shard group (FSDP2's 2-D mesh ``(dp_replicate, dp_shard)``): each
    group of dp_shard ranks holds one sharded copy; gradients reduce-scatter inside a group and
    all-reduce across groups. With several nodes, dp_shard = GPUs per node keeps the all-gathers
    on the node's own links and only one gradient all-reduce crosses nodes. 1: plain FSDP."""
    dp_shard: int = Field(-1)
    """FSDP2 sharding degree; -1 means "whatever the other degrees leave"."""
    tp: int = Field(1, gt=0)
    """Tensor-parallel degree (keep it within one node)."""
    ep: int = Field(1, gt=0)
    """Expert-parallel degree for MoE models (experts are split over ep ranks)."""
    replicate: bool = False
    """DDP-style replication instead of sharding over the data-parallel ranks (planner's rung 1)."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (ZeRO-3-like); false keeps them (ZeRO-2-like)."""
    pp: int = Field(1, gt=0)
    """Pipeline-parallel degree: the layers split into pp stages across ranks (the outermost mesh
    dimension, so with one stage per node only activations cross the nodes' link)."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev"] = "1f1b"
    """The pipeline schedule (torch.distributed.pipelining): gpipe, 1f1b, interleaved-1f1b, zbv
    (zero-bubble V), dualpipev. The interleaved and V schedules hold several stages per rank."""
    pp_stages_per_rank: int | None = Field(None, gt=0)
    """Virtual stages per rank; default 1 for gpipe/1f1b, 2 for interleaved-1f1b, zbv, dualpipev
    (the V schedules need exactly 2)."""
    pp_microbatches: int | None = Field(None, gt=0)
    """Microbatches per optimizer step fed through the pipeline; default: the gradient-accumulation
    count (batch_size / (dp × micro_batch_size)). Fewer than the stages leaves a bubble or hangs."""
    cp: int = Field(1, gt=0)
    """Context-parallel degree: each rank holds seq_len / cp tokens of every sequence (head-tail
    balanced); keys and values are gathered for attention. seq_len must be divisible by 2·cp; composes
    with dp, tp and pp, not with ep > 1 (refused before anything is rented)."""

    @field_validator("dp_shard")
    @classmethod
    def _dp(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("must be a positive integer or -1 (the rest)")
        return v


class Trainer(_Model):
    """The bundled trainer."""

    model: Union[str, ModelSpec] = "tiny"
    """A preset name (tiny, tiny-moe, gpt2-124m, gpt2-1.5b, llama3-8b, llama3-70b, moe-small)
    or explicit sizes."""
    parallel: Union[Parallel, Literal["auto"]] = Field(default_factory=Parallel)
    """Parallel degrees, or auto (the memory planner picks the simplest rung that fits)."""
    steps: int | None = Field(None, gt=0)
    """Optimizer steps to train. Give steps or tokens."""
    tokens: int | None = Field(None, gt=0)
    """Token budget; steps = tokens / (batch_size × seq_len)."""
    batch_size: int = Field(8, gt=0)
    """Global batch in sequences per optimizer step."""
    micro_batch_size: int | None = Field(None, gt=0)
    """Sequences per rank per forward pass (gradient accumulation makes up the rest);
    default: batch_size / data-parallel ranks."""
    seq_len: int = Field(128, gt=0)
    """Tokens per sequence."""
    data: str = "synthetic"
    """Training data: synthetic (seeded random tokens, for tests) or a URI/path of token shards
    (llm.c .bin with a uint16 or uint32 header, or .npy, read through fsspec; a directory or glob).
    A directory or glob never feeds validation shards (a name holding ``val``, as llm.c's
    ``fineweb_val_000000.bin``) into training."""
    val_data: str | None = None
    """Validation token shards (URI/path, a directory or glob). Default: the validation-named shards
    (``val_*.bin``, as `dtrun data prepare` writes them) beside ``data``, if there are any."""
    eval_every: int | None = Field(None, gt=0)
    """Validation loss every N steps (and after the last step); null: only after the last step.
    Needs validation shards (``val_data``)."""
    eval_tokens: int = Field(65536, gt=0)
    """Validation tokens per evaluation (read in order from the start of the validation shards)."""
    trackers: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list)
    """Optional experiment trackers: tensorboard (event files under <run-uri>/tensorboard/) and wandb
    (needs the wandb package and WANDB_API_KEY in the node's environment; the key is never stored)."""
    device: Literal["auto", "cpu"] = "auto"
    """Where the ranks compute. auto: CUDA when ``resources.gpu`` names a GPU (refused, exit 2, when
    CUDA cannot serve the node's ranks: never a silent fallback), CPU for ``gpu: cpu``. cpu: CPU
    ranks over gloo even on a GPU node, chosen explicitly — a smoke run of the whole launch path
    (provisioning, setup, checkpoints, preemption, teardown) on a small model before the real
    run. Timed at CPU speed, priced as the node it rents."""
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    """Parameter/compute precision on GPU (FSDP2 mixed precision, fp32 reduce). CPU always runs fp32."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """AdamW, or Muon (orthogonalized updates on 2-D weights, AdamW on the rest)."""
    lr: float = Field(3e-4, gt=0)
    """Peak learning rate."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final LR of the cosine decay as a fraction of lr."""
    warmup_steps: int = Field(10, ge=0)
    """Linear LR warmup steps."""
    weight_decay: float = Field(0.1, ge=0)
    """AdamW weight decay (not applied to norms, biases and embeddings)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Global-norm gradient clipping (null: off)."""
    z_loss: float = Field(0.0, ge=0)
    """z-loss coefficient on the logits' log-partition (PaLM); 0 disables."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Recompute activations in backward: none, selective (every other block) or full."""
    compile: bool = False
    """torch.compile each block (GPU only; no gain on CPU)."""
    fp8: bool = False
    """fp8 linear layers through torchao (Hopper or newer, opt-in)."""
    seed: int = 1234
    """Seed for initialisation, data order and dropout."""
    log_every: int = Field(10, gt=0)
    """A log line (and a metrics.jsonl row) every N steps."""
    heartbeat_seconds: float = Field(5.0, gt=0)
    """How often progress.json is rewritten."""
    collective_timeout_seconds: float = Field(600.0, ge=1, le=7200)
    """Most a rank waits in one collective (NCCL and gloo: training, checkpoint groups) for a
    peer before it gives up: a rank that died or hung on another node ends the survivors after
    this long, exit 75 (the attempt resumes from the last COMMITTED checkpoint), not torch's
    30-minute default. Raise it if one rank can legitimately lag the others longer (a checkpoint
    upload's spread between ranks, a slow first compile). The emergency save at a preemption
    notice is bounded by the notice instead."""

    @model_validator(mode="after")
    def _check(self) -> "Trainer":
        if isinstance(self.model, str):
            resolve_model(self.model)  # raises a clear ValueError for unknown presets
        if self.steps is None and self.tokens is None:
            raise ValueError("give trainer.steps or trainer.tokens")
        if self.steps is not None and self.tokens is not None:
            raise ValueError("give trainer.steps or trainer.tokens, not both")
        if self.seq_len > self.model_spec.max_seq_len:
            raise ValueError(
                f"seq_len ({self.seq_len}) exceeds the model's max_seq_len ({self.model_spec.max_seq_len})"
            )
        return self

    @property
    def model_spec(self) -> ModelSpec:
        return resolve_model(self.model)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def total_steps(self) -> int:
        if self.steps is not None:
            return self.steps
        assert self.tokens is not None
        return max(1, -(-self.tokens // self.tokens_per_step))

    @property
    def total_tokens(self) -> int:
        return self.total_steps * self.tokens_per_step


CHECKPOINT_FORMATS = ("hf", "lightning", "dcp", "marker")
DEFAULT_STEP_PATTERN = r"(?i)\b(?:global_step|step|iter(?:ation)?)\b['\"]?\s*[=:]?\s*(\d+)(?:\s*/\s*(\d+))?"
"""The default progress pattern: ``step 120``, ``step=120``, ``step: 120/1000``, ``iter 120``,
``'global_step': 120`` (group 1 the step, optional group 2 the total)."""
DEFAULT_LOSS_PATTERN = r"(?i)['\"]?\bloss\b['\"]?\s*[=:]?\s*([-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)"


class Command(_Model):
    """Your own training code instead of the bundled trainer (``command:`` replaces ``trainer:``).
    The node contract (docs/user-code.md): ``DTRUN_CHECKPOINT_DIR`` holds the newest
    COMMITTED checkpoint before the command starts; what the script saves there is uploaded and
    committed; SIGTERM means "checkpoint now"; exit 75 means "checkpointed, resume me"."""

    run: str = Field(min_length=1)
    """The command. With ``torchrun: true`` the script and its arguments as torchrun takes them
    (``train.py --lr 3e-4`` or ``-m pkg.train``), run on every node; else a shell command run once
    per node as given. ``$DTRUN_CHECKPOINT_DIR`` and the other DTRUN_ variables are expanded."""
    torchrun: bool = True
    """Run under torchrun (one process per GPU, rendezvous across nodes) or as given."""
    code: str = "."
    """The code folder shipped to every node (relative to the job file): its files minus
    ``.gitignore``d ones and files over ``max_file_mb`` (both left out with a warning naming them)."""
    max_file_mb: float = Field(20.0, gt=0)
    """Files larger than this (MiB) are not shipped (data and weights belong in object storage)."""
    setup: list[str] = Field(default_factory=list)
    """Shell commands run in the code folder on each node before the command (each must exit 0)."""
    requirements: str | None = None
    """A requirements file in the code folder, installed with pip before the setup commands."""
    checkpoint_format: Literal["hf", "lightning", "dcp", "marker"] = "marker"
    """How the node recognises a finished checkpoint in DTRUN_CHECKPOINT_DIR: hf (``checkpoint-N/``
    with trainer_state.json, once the next save began or the command exited), lightning (a
    ``*.ckpt`` file, written atomically), dcp (a folder with ``.metadata``), marker (a folder
    holding a ``DONE_WRITING`` file)."""
    hours: float | None = Field(None, gt=0)
    """How long one uninterrupted run takes (wall hours on the chosen GPUs). Give hours, or
    params + tokens."""
    params: float | None = Field(None, gt=0)
    """Model parameters (for the 6·N·D estimate at ``budget.mfu``, and the checkpoint size)."""
    tokens: float | None = Field(None, gt=0)
    """Training tokens (for the 6·N·D estimate)."""
    steps: int | None = Field(None, gt=0)
    """Total optimizer steps, if known (shown beside the progress; optional)."""
    checkpoint_every_minutes: float = Field(30.0, gt=0)
    """How often the script checkpoints: the work a hard preemption loses (half of it on average)."""
    step_pattern: str = DEFAULT_STEP_PATTERN
    """Regex over the command's output lines: group 1 is the step (optional group 2 the total). The
    node's heartbeat and the controller's idle detection follow it."""
    loss_pattern: str | None = DEFAULT_LOSS_PATTERN
    """Regex for the loss on a line the step pattern matched (group 1); null: no loss."""

    @field_validator("step_pattern", "loss_pattern")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                rx = re.compile(v)
            except re.error as e:
                raise ValueError(f"not a regular expression: {e}") from None
            if rx.groups < 1:
                raise ValueError("needs a capturing group (the number)")
        return v

    @model_validator(mode="after")
    def _check(self) -> "Command":
        if self.hours is None and (self.params is None or self.tokens is None):
            raise ValueError("give command.hours, or command.params and command.tokens (the 6·N·D estimate)")
        if self.hours is not None and (self.params is not None and self.tokens is not None):
            raise ValueError("give command.hours or command.params + command.tokens, not both")
        return self


class Checkpoint(_Model):
    """Where the run's state lives: the run URI (the contract between controller and trainer)."""

    uri: str = "file://./runs/{name}"
    """Run URI: s3://bucket/prefix, file://path or a plain path (a relative one is relative to the job
    file's folder, not the working directory). {name} is replaced by the job name."""
    every_steps: Union[int, Literal["auto"]] = 100
    """Checkpoint interval in steps, or auto (Young/Daly from the checkpoint cost and the expected
    time between preemptions)."""
    keep: int = Field(2, ge=2)
    """Keep the newest K COMMITTED checkpoints (K ≥ 2: the newest may still be writing)."""
    async_mode: Literal["async", "sync"] = "async"
    """DCP async_save (the loop stalls only for staging) or a blocking save."""
    preflight: bool | None = None
    """Save and restore a round trip against the run URI before the long run (default: on for spot)."""

    @field_validator("every_steps")
    @classmethod
    def _every(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v <= 0:
            raise ValueError("must be a positive number of steps or auto")
        return v


class Budget(_Model):
    """Money and time limits. The dry run refuses a plan over max_usd."""

    max_usd: float | None = Field(None, gt=0)
    """Most the job may spend, in USD, across all attempts (null: no cap; a warning)."""
    hours: float | None = Field(None, gt=0)
    """Expected run time; if absent it is derived from the token budget and the GPU's throughput."""
    buffer: float = Field(0.20, ge=0, le=5)
    """Safety margin on the estimate (0.20 = +20%)."""
    max_hours: float | None = Field(None, gt=0)
    """Hard deadline in wall hours from the first launch: the run checkpoints and stops there."""
    cut_at_deadline: bool = False
    """The deadline is meant to cut the run short: a plan whose estimate is longer than
    max_hours is accepted (priced up to the deadline) instead of refused (exit 3)."""
    mfu: float = Field(0.40, gt=0, le=1)
    """Model FLOPs utilisation assumed for derived hours."""


class Teardown(_Model):
    """When nodes go away on their own."""

    idle_minutes: float = Field(30, gt=0)
    """No training progress for this long → checkpoint (if possible) and tear down."""
    controller_lost_minutes: float | None = Field(None, gt=0)
    """If set, nodes checkpoint and stop once the controller's lease is this stale (default: off,
    the node finishes the run on its own)."""


class Recovery(_Model):
    """How hard the controller tries before giving up."""

    max_attempts: int = Field(20, gt=0)
    """Most failed launches and crashes across the job (capacity misses, API errors, trainer
    failures, lost nodes). Preemptions do not count: budget, deadline and
    max_preemptions_per_hour bound them."""
    max_preemptions_per_hour: float | None = Field(12, gt=0)
    """Stop the job (FAILED, with a reason saying so) when more than this many preemptions ended
    within the last hour: a preemption storm (null: no rate limit; budget and deadline still apply)."""
    max_restarts_on_errors: int = Field(2, ge=0)
    """Trainer failures (non-zero exit that is not a preemption) restarted before the job FAILs."""
    max_recovery_minutes: float = Field(60, gt=0)
    """Give up if no node is running for this long in one recovery."""
    poll_seconds: float = Field(5.0, gt=0)
    """Controller tick: provider poll and run-URI read."""
    heartbeat_timeout_seconds: float = Field(300, gt=0)
    """A RUNNING node whose progress.json is older than this is treated as lost."""
    backoff_seconds: float = Field(10, ge=0)
    """First relaunch delay; doubles per consecutive failure, capped at 5 minutes."""
