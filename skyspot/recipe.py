"""Recipes: what to train and where, as typed, validated configuration.

A recipe is a YAML file (see `recipes/`). Loading applies one precedence rule,
written here once:

    flags (--store, --clouds, ...) > command-line overrides (the later word wins)
        > SKYSPOT_<SECTION>__<KEY> environment > recipe file > defaults

Command-line overrides are `section.key=value` (`train.steps=40`); the value is read
as YAML (1.2's numbers), so `train.lr=1e-4` is a float and `resources.clouds=[aws,gcp]` a list.
Types are strict: `train.steps=true` or `5.0` is an error, never 1 or 5. Unknown keys and a key
given twice are rejected, and every problem is reported together, with file and line.

One module, though long: the schema, the precedence rule and the override syntax are one contract
(what a recipe value is, and how one is set), read the same way by the CLI and by the trainer.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Optional, Sequence, Union, overload

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from skyspot import yaml12
from skyspot.errors import RecipeError, UsageError

RECIPES_DIR = Path(__file__).parent / "recipes"

# The static registry behind `skyspot recipes`: name -> file in skyspot/recipes/.
# A name resolves only through this table; it can never reach another file.
REGISTRY: dict[str, str] = {
    "llama70b": "llama70b.yaml",
    "llama70b-lora": "llama70b-lora.yaml",
    "llama8b": "llama8b.yaml",
    "llama8b-lora": "llama8b-lora.yaml",
    "smollm2-360m": "smollm2-360m.yaml",
    "tiny": "tiny.yaml",
}

CLOUDS: tuple[Cloud, ...] = ("aws", "gcp", "azure")
Cloud = Literal["aws", "gcp", "azure"]

# Accelerator names as SkyPilot spells them (`sky show-gpus`), for the ones this tool targets.
KNOWN_ACCELERATORS = (
    "A100",
    "A100-80GB",
    "H100",
    "H100-MEGA",
    "H200",
    "B200",
    "L4",
    "L40S",
    "A10G",
    "V100",
    "T4",
)

ENV_PREFIX = "SKYSPOT_"

# Bounds on what a recipe file can ask for. Recipe values end up in YAML, shell commands,
# SQLite INTEGER columns (int64) and the trainer, so nothing unbounded gets through.
MAX_RECIPE_BYTES = 1 << 20
MAX_RECIPE_NODES = 100_000  # YAML scalars after aliases are expanded (a "billion laughs" file stops here)
BIG = 10**12  # steps, samples and the like: far beyond any run, far below int64

# Hugging Face repo ids: `name` or `org/name`, letters, digits, '-', '_', '.', no '..' (huggingface_hub validate_repo_id).
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?")


def _one_line(value: str) -> str:
    # A recipe string reaches a YAML comment, a shell variable or a log line: a line break or a
    # control character there could inject a key, break the YAML or forge a line.
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise ValueError(f"must be one line of printable text (found {bad!r})")
    return value


Text = Annotated[str, AfterValidator(_one_line)]


def _finite_tree(value: Any) -> Any:
    """A free-form mapping (model.config, deepspeed.extra) holds no infinity or NaN at any depth: the
    typed sections refuse them (allow_inf_nan=False), and these reach the trainer's config as they are."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            raise ValueError(f"{where.lstrip('.') or 'the value'} is {node!r}; only finite numbers")
        if isinstance(node, dict):
            stack.extend((f"{where}.{key}", child) for key, child in node.items())
        elif isinstance(node, list):
            stack.extend((f"{where}[{i}]", child) for i, child in enumerate(node))
    return value


FreeForm = Annotated[dict[str, Any], AfterValidator(_finite_tree)]


@overload
def _hub_id(value: str) -> str: ...
@overload
def _hub_id(value: None) -> None: ...
def _hub_id(value: Optional[str]) -> Optional[str]:
    if value is not None and (not _HUB_ID.fullmatch(value) or ".." in value):
        # repr: the message crosses into pydantic-core, which cannot carry lone surrogates.
        raise ValueError(f"{value!r} is not a Hugging Face repo id (org/name)")
    return value


def _hub_ref(value: Optional[str]) -> Optional[str]:
    """A hub id, or a local directory given as an absolute path (or ~/...), made absolute."""
    if value is None:
        return None
    from skyspot.hub import is_local_ref  # import-light

    if is_local_ref(value):
        _one_line(value)
        return os.path.abspath(os.path.expanduser(value))
    if value.startswith(".") or value.count("/") > 1:
        raise ValueError(
            f"{value!r} is not a Hugging Face repo id (org/name) nor an absolute path; give a "
            "local directory as an absolute path (the trainer may run in another directory)"
        )
    return _hub_id(value)


# A git revision on the hub: a branch, a tag or a commit sha (huggingface_hub passes it in a URL path).
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")


def _revision(value: Optional[str]) -> Optional[str]:
    if value is not None and (not _REVISION.fullmatch(value) or ".." in value):
        raise ValueError(f"{value!r} is not a hub revision (a branch, a tag or a commit sha)")
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, strict=True)


class ModelSection(_Section):
    hub_id: Annotated[Optional[str], AfterValidator(_hub_ref)] = None
    """The pretrained base model: a Hugging Face hub id (meta-llama/Llama-3.1-70B) or a local directory
    (an absolute path) holding config.json and *.safetensors, as save_pretrained writes them."""
    revision: Annotated[Optional[str], AfterValidator(_revision)] = None
    """Hub models only: the branch, tag or commit to load (default: main). A commit sha pins the weights."""
    config: Optional[FreeForm] = None
    """An inline transformers config (LlamaConfig fields) for a model built from scratch, no download."""
    gated: bool = False
    """The hub model needs an access token: HF_TOKEN is passed to the task as a secret."""
    tokenizer: Annotated[Optional[str], AfterValidator(lambda v: v if v == "bytes" else _hub_ref(v))] = None
    """Tokenizer: a hub id or a local directory; default the model's own. `bytes` is the built-in byte
    tokenizer (no download; the default for model.config)."""

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSection":
        if (self.hub_id is None) == (self.config is None):
            raise ValueError("set exactly one of model.hub_id and model.config")
        if self.config is not None and self.tokenizer is None:
            self.tokenizer = "bytes"
        if self.revision is not None and (self.hub_id is None or self.is_local):
            raise ValueError(
                "model.revision applies to a hub model (model.hub_id = org/name), not to "
                + ("a local directory" if self.hub_id else "model.config")
            )
        return self

    @property
    def is_local(self) -> bool:
        """model.hub_id names a local directory."""
        return self.hub_id is not None and self.hub_id.startswith("/")


class DataSection(_Section):
    source: Text = Field(min_length=1)
    """`synthetic`, a hub dataset `hf://org/name[:split]`, a local `.jsonl`, `.json`, `.parquet` or `.txt`
    file, or such a file in a bucket (s3://, gs://, az://: the task mounts it)."""
    format: Literal["text", "alpaca", "chat"] = "text"
    """How a record becomes tokens: `text` (its `text_field`; loss on every token), `alpaca` (instruction,
    input, output through the Alpaca prompt; loss on the output only) or `chat` (its `messages_field`
    through the tokenizer's chat template; loss on the assistant turns only)."""
    text_field: Text = "text"
    """format=text: the field of each record (JSON object or dataset row) that holds the text."""
    messages_field: Text = "messages"
    """format=chat: the field that holds the conversation, a list of {role, content}."""
    packing: bool = True
    """Concatenate examples into full train.seq_len sequences (no padding; an example may continue in the
    next sequence). Off: one example per sequence, truncated to seq_len and padded (no loss on padding)."""
    split: Text = "train"
    """Hub dataset split (`hf://org/name:split` overrides it)."""
    num_samples: int = Field(4096, ge=1, le=BIG)
    """Synthetic set only: how many sequences it holds."""
    shuffle: bool = True
    """Shuffle the sample order each epoch (deterministically, from train.seed and the epoch)."""
    eval_split: Optional[Text] = None
    """Held-out data for evaluation (eval section): for a hub source, the dataset's split to read
    (`validation`); for a file source, a second file of the same format (a path or a bucket URI). Never
    trained on. Unset: `eval.fraction` of the training data, or no evaluation."""

    @field_validator("source")
    @classmethod
    def _valid_source(cls, value: str) -> str:
        # The task mounts a bucket source and hands the mount path to the trainer, so only
        # bucket URIs the store knows (s3, gs, az) or hf:// may carry a scheme.
        if value.startswith("hf://"):
            name, colon, split = value[len("hf://") :].partition(":")
            if colon and not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}", split):
                raise ValueError(f"{split!r} is not a dataset split name (hf://org/name:split)")
            return "hf://" + _hub_id(name) + (f":{split}" if colon else "")
        if value == "synthetic":
            return value
        from skyspot.storage import canonical  # import-light: no cloud SDKs

        try:
            # One spelling (storage/uri.py): `S3://b/x` is s3://b/x; file:///x and a relative or ~/ path
            # are this machine's absolute path, so a trainer started elsewhere (the local executor runs
            # it in the run directory) reads the same file.
            return canonical(value)
        except UsageError as err:
            raise ValueError(
                str(err).replace("store", "data source", 1) + " (or synthetic, or hf://ORG/NAME)"
            ) from None

    @field_validator("eval_split")
    @classmethod
    def _valid_eval_split(cls, value: Optional[str], info: ValidationInfo) -> Optional[str]:
        # Validated like `source` (after it, since its meaning follows the source's kind): a split name
        # for a hub source, else a file in the same spelling `source` gets (the task mounts a bucket one).
        source = info.data.get("source")
        if value is None or source is None:  # no source: its own error says why
            return value
        if source == "synthetic":
            raise ValueError(
                "data.eval_split names a split of a hub dataset or a second data file; the synthetic "
                "set has neither: use eval.fraction"
            )
        if source.startswith("hf://"):
            if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}", value):
                raise ValueError(f"data.eval_split {value!r} is not a dataset split name (e.g. validation)")
            return value
        if value.startswith("hf://"):
            raise ValueError("data.eval_split of a file source is a second file of the same format, not a hub dataset")
        from skyspot.storage import canonical

        try:
            held_out = canonical(value)
        except UsageError as err:
            raise ValueError("data.eval_split: " + str(err).replace("store", "data file", 1)) from None
        if held_out == source:  # issue 31.13: the model would be scored on what it trained on
            raise ValueError(
                "data.eval_split is data.source itself: the evaluation would score the training data; "
                "name a held-out file, or use eval.fraction"
            )
        return held_out


# The linear layers of a Llama-style decoder (attention and MLP): LoRA's default targets.
LLAMA_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSection(_Section):
    r: int = Field(16, ge=1, le=4096)
    """Rank of each adapter: a frozen layer W gets W + (alpha / r) * B @ A, A of shape r x in, B out x r."""
    alpha: float = Field(32.0, gt=0, le=1e6)
    """Scale of the adapters' update (alpha / r)."""
    dropout: float = Field(0.05, ge=0, lt=1)
    """Dropout on each adapter's input."""
    target_modules: list[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.]{0,127}$")]] = Field(
        default_factory=lambda: list(LLAMA_LINEAR), min_length=1
    )
    """Layers that get adapters, by module name (as peft matches them). Default: every linear layer of a
    Llama-style block."""


class TrainSection(_Section):
    steps: int = Field(ge=1, le=BIG)
    """Optimizer steps to train."""
    micro_batch_size: int = Field(ge=1, le=1 << 20)
    """Sequences per rank per forward pass."""
    grad_accum: int = Field(1, ge=1, le=1 << 20)
    """Micro-batches accumulated per optimizer step."""
    lr: float = Field(ge=0)
    """Peak learning rate (0 leaves the weights untouched: a check of the loading path)."""
    seq_len: int = Field(ge=8, le=1 << 24)
    """Tokens per packed sequence."""
    seed: int = Field(1234, ge=0, lt=2**32)
    """Seed for model init, data order and dropout (numpy and torch both take 0 <= seed < 2**32)."""
    warmup_steps: int = Field(0, ge=0, le=BIG)
    """Linear warm-up steps, then cosine decay to lr * min_lr_ratio."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final learning rate as a fraction of the peak."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, ge=0)
    """Gradient norm clipping (0 disables)."""
    log_every: int = Field(10, ge=1, le=BIG)
    """Print a loss line every N steps (rank 0)."""
    lora: Optional[LoraSection] = None
    """LoRA (through peft): train low-rank adapters on a frozen base; checkpoints hold only the adapters'
    state. Unset: a full fine-tune. `train.lora={}` turns it on with the defaults."""


class DeepSpeedSection(_Section):
    zero_stage: Literal[0, 1, 2, 3] = 3
    """ZeRO stage; 3 shards parameters, gradients and optimizer state across ranks."""
    bf16: bool = False
    """bf16 mixed precision (GPUs); CPU runs use fp32."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    offload_optimizer: Literal["none", "cpu"] = "none"
    """ZeRO-Offload of optimizer state."""
    offload_params: Literal["none", "cpu"] = "none"
    """ZeRO-Infinity offload of parameters."""
    extra: FreeForm = Field(default_factory=dict)
    """Merged last into the generated DeepSpeed config (expert escape hatch)."""


class CheckpointSection(_Section):
    every_steps: Optional[int] = Field(None, ge=1, le=BIG)
    """Interval checkpoint every N steps."""
    every_seconds: Optional[Union[float, Literal["auto"]]] = None
    """Interval checkpoint every N seconds of training; `auto` plans it from the preemption rate."""
    keep: int = Field(3, ge=1, le=1000)
    """Committed checkpoints kept per tier (the newest valid one is never deleted)."""
    min_every_seconds: Optional[float] = Field(None, gt=0, le=BIG)
    """With every_seconds=auto: the shortest interval the planner may choose (default 60 s)."""
    mtbp_prior_seconds: Optional[float] = Field(None, gt=0, le=BIG)
    """With every_seconds=auto: your prior mean time between preemptions of the whole job (default:
    skyspot's per cloud and accelerator prior, docs/planning.md); the run's own preemptions refine it."""
    train_through_notice: bool = True
    """After a preemption notice, keep training while the emergency checkpoint, predicted from this
    run's measured save and upload times, still becomes durable before the notice's deadline; false:
    save at the next step boundary. A signal without a notice always saves at the next step."""
    notice_margin_seconds: float = Field(2.0, ge=0, le=3600)
    """With train_through_notice: seconds kept free before the upload deadline (the notice's deadline
    less 3 s to record the exit) on top of the next step and the predicted save, which are padded by a
    quarter."""

    @field_validator("every_seconds")
    @classmethod
    def _positive(cls, value: Union[float, Literal["auto"], None]) -> Union[float, Literal["auto"], None]:
        if isinstance(value, (int, float)) and value <= 0:
            raise ValueError("must be > 0 or 'auto'")
        return value


def _deadline(value: Optional[str]) -> Optional[str]:
    if value is not None:
        from skyspot.deadline_text import check_deadline_text  # import-light: the standard library only

        check_deadline_text(value)
    return value


class ResourcesSection(_Section):
    accelerators: list[Text] = Field(default_factory=list)
    """Accelerator candidates per node as SkyPilot spells them, e.g. `H100:8`. Empty: CPU nodes."""
    num_nodes: int = Field(ge=1, le=1024)
    """Nodes in the cluster."""
    min_nodes: Optional[int] = Field(None, ge=1, le=1024)
    """Fewest nodes the run may resume on when spot capacity shrinks (default: num_nodes). The
    trainer reshards ZeRO-3 state to the new world size; needs storage.store (docs/planning.md)."""
    clouds: list[Cloud] = Field(default_factory=lambda: list(CLOUDS))
    """Clouds to place the job on."""
    regions: list[Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")]] = Field(default_factory=list)
    """Optional: restrict placement to these regions (each belongs to one of the clouds)."""
    spot: bool = True
    """Use spot/preemptible capacity first."""
    on_demand_fallback: bool = True
    """Add on-demand candidates after every spot candidate."""
    cpu_ranks: Optional[int] = Field(None, ge=1, le=1024)
    """Ranks per node when there are no accelerators (CPU training)."""
    cpus: Optional[Annotated[str, Field(pattern=r"^[0-9]{1,4}(\.[0-9]{1,2})?\+?$")]] = None
    """vCPUs per node as SkyPilot spells them (`8+`)."""
    network_tier: Optional[Literal["standard", "best"]] = None
    """`best`: the fast inter-node fabric where SkyPilot provides one (SkyPilot's `network_tier`: EFA on
    AWS, GPUDirect-TCPX on GCP H100:8); each candidate that cannot have it runs without it and the plan
    says why (docs/clouds.md, "The fabric"). For multi-node recipes: ZeRO-3 over plain TCP crawls."""
    placement: Literal["expected_cost", "price"] = "expected_cost"
    """How candidates are ordered within spot and within on-demand: `expected_cost` (price, egress and the
    expected preemptions' restarts and lost work, from this machine's preemption history blended with the
    cloud's prior) or `price` (nodes + egress only). docs/reliability.md, "Placement by expected cost"."""
    burst_minutes: float = Field(30.0, ge=0, le=10080)
    """How long a spot instance taken counts against its zone and region when `expected_cost` places a
    recovery: a recent preemption raises the place's expected cost by the restarts it predicts (0: the
    price order). Applied by the local executor's zoned traces (executors/local/zones.py) and, on a cloud, by
    a supervised run's controller (`supervise`, a deadline): planning/bursts.py."""
    supervise: bool = False
    """Cloud runs: skyspot's controller job (one small on-demand CPU VM, the one a deadline runs) supervises
    the run, and after a spot preemption the next stage tries the preempted region only after the regions whose
    price is below its expected cost for `burst_minutes` (planning/bursts.py), which SkyPilot 0.14.1's own
    recovery never does (docs/planning.md, "Recoveries on a cloud"). Needs a SkyPilot API server
    that managed jobs can reach. A deadline is always supervised; the local executor places by its zoned
    traces instead."""
    disk_size: int = Field(256, ge=50, le=65536)
    """Disk per node in GB (the fast checkpoint tier lives there)."""
    local_only: bool = False
    """The recipe is meant for the embedded local executor (e.g. `tiny`): `launch` runs it locally."""
    deadline: Annotated[Optional[str], AfterValidator(_deadline)] = None
    """Finish by then at the least cost (docs/deadline.md): a duration from launch (`36h`, `90m`, `2d`,
    `1h30m`) or an ISO 8601 time (`2026-05-01T17:00+02:00`; without an offset, the launching machine's
    local time). Spot while there is slack, on-demand when behind. `launch --deadline` sets it."""
    deadline_policy: Literal["adaptive", "uniform-progress", "greedy"] = "adaptive"
    """With a deadline: `uniform-progress` (Can't Be Late, NSDI 2024: spot while ahead of a straight line
    to the deadline, on-demand when behind), `adaptive` (the same, waiting for spot as greedy does while
    the slack affords few restarts) or `greedy` (spot until the slack runs out, then on-demand)."""
    step_seconds_hint: Optional[float] = Field(None, gt=0, le=BIG)
    """With a deadline: seconds per optimizer step on these nodes, used until the run has measured its
    own, and by `launch` to refuse a deadline that even on-demand cannot make."""

    @field_validator("clouds", "regions", "accelerators", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:  # mode="before": whatever the YAML held
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        return value

    @field_validator("clouds", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        if isinstance(value, list):
            return [v.lower() if isinstance(v, str) else v for v in value]
        return value

    @field_validator("accelerators")
    @classmethod
    def _known_accelerators(cls, value: list[str]) -> list[str]:
        problems = []
        for spec in value:
            name, _, count = spec.partition(":")
            if name not in KNOWN_ACCELERATORS:
                close = difflib.get_close_matches(name.upper(), KNOWN_ACCELERATORS, n=1, cutoff=0.5)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                problems.append(f"unknown accelerator {name!r}{hint} (known: {', '.join(KNOWN_ACCELERATORS)})")
            elif count and (not re.fullmatch(r"[0-9]{1,3}", count) or not 1 <= int(count) <= 64):
                problems.append(f"accelerator count in {spec!r} must be an integer from 1 to 64")
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @model_validator(mode="after")
    def _placement(self) -> "ResourcesSection":
        if not self.clouds:
            raise ValueError("resources.clouds must name at least one of aws, gcp, azure")
        if not self.spot and not self.on_demand_fallback:
            raise ValueError("resources.spot and resources.on_demand_fallback are both off: nothing to launch on")
        if self.min_nodes is not None and self.min_nodes > self.num_nodes:
            raise ValueError(f"resources.min_nodes ({self.min_nodes}) is above resources.num_nodes ({self.num_nodes})")
        return self

    @property
    def fewest_nodes(self) -> int:
        return self.min_nodes if self.min_nodes is not None else self.num_nodes

    @property
    def ranks_per_node(self) -> int:
        """Ranks per node: the accelerator count, or cpu_ranks for CPU nodes."""
        if self.accelerators:
            _, _, count = self.accelerators[0].partition(":")
            return int(count or 1)
        return self.cpu_ranks or 1


class StorageSection(_Section):
    store: Optional[Text] = None
    """Where the run's checkpoints and events live: s3://bucket/prefix, gs://…, az://… or a local path."""

    @field_validator("store")
    @classmethod
    def _valid_store(cls, value: Optional[str]) -> Optional[str]:
        if value:
            from skyspot.storage import canonical  # import-light: no cloud SDKs

            try:
                # The store's one spelling (storage/uri.py): what the ledger records, what the task
                # mounts and what the trainer resolves are this string. A relative path is made
                # absolute here, where it was given, not in the run directory the trainer runs in.
                return canonical(value)
            except UsageError as err:
                raise ValueError(str(err)) from None
        return value


class ExportSection(_Section):
    merge: bool = False
    """With train.lora: also write final/merged/, the base with the adapters merged in, which
    from_pretrained loads without peft. final/ itself holds the adapter either way."""


class EvalSection(_Section):
    fraction: Optional[float] = Field(None, gt=0, lt=0.5)
    """Hold out this fraction of the training data for evaluation when data.eval_split is not set:
    chosen deterministically from train.seed, the same on every start, never trained on."""
    every_steps: Optional[int] = Field(None, ge=1, le=BIG)
    """Evaluate every N optimizer steps (and always at the end, when there is a held-out set)."""
    every_seconds: Optional[float] = Field(None, gt=0, le=BIG)
    """Evaluate when this many seconds of training have passed since the last evaluation."""
    batches: int = Field(8, ge=1, le=1 << 20)
    """Micro-batches per rank in one evaluation (train.micro_batch_size sequences each), the same ones
    every time, so evaluations are comparable across the run and exact across resumes."""


class MetricsSection(_Section):
    backends: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default_factory=list)
    """Dashboards the trainer's rank 0 writes to, any subset of tensorboard, wandb, mlflow (none by
    default): one run across every attempt, no step drawn twice (docs/trainer.md, "Metrics")."""
    every_steps: int = Field(1, ge=1, le=BIG)
    """Log the training scalars every N steps (evaluations are logged as they happen)."""
    wandb_project: Text = "skyspot"
    """W&B project (WANDB_API_KEY reaches the node as a secret; the run name is the W&B run id)."""
    wandb_entity: Optional[Text] = None
    """W&B entity (user or team); default: the key's own."""
    mlflow_tracking_uri: Optional[Text] = None
    """MLflow tracking server (`https://...`) or file store; default: MLFLOW_TRACKING_URI on the node,
    else `<run dir>/mlruns`. MLFLOW_TRACKING_TOKEN reaches the node as a secret."""
    mlflow_experiment: Text = "skyspot"
    """MLflow experiment name."""

    @field_validator("backends")
    @classmethod
    def _once_each(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("each backend once")
        return value


class ResilienceSection(_Section):
    restarts_in_place: int = Field(3, ge=0, le=1000)
    """In-place restarts per hour of an attempt: when a rank fails (a crash, an NCCL error, a hang the
    watchdog ends), every rank on every node restarts on the same machines and resumes from the newest
    committed local checkpoint. Past the budget the node exits with the error and SkyPilot re-provisions
    (max_restarts_on_errors). 0: every failure ends the attempt. Preemptions always take new machines."""
    restart_backoff_seconds: float = Field(5.0, ge=0, le=3600)
    """Wait before the k-th in-place restart within the hour: this times 2**(k-1), at most 300 s."""
    watchdog: bool = True
    """Watch for hangs: no step for longer than the bound below; dump every rank's stacks (py-spy), record
    a `hang` event and restart the ranks in place."""
    hang_factor: float = Field(10.0, ge=2, le=1e6)
    """A hang is no step for longer than max(hang_factor x the run's median step time, hang_floor_seconds)."""
    hang_floor_seconds: float = Field(300.0, gt=0, le=BIG)
    """The shortest time without a step that counts as a hang, once steps have been measured."""
    first_step_seconds: float = Field(3600.0, gt=0, le=BIG)
    """The bound for the first step after a start (model download and load, resume, compile); raised for a
    model whose download at the planned bandwidth could outlast it (skyspot/start_bounds.py)."""


class FabricSection(_Section):
    require: Literal["warn", "best"] = "warn"
    """What a multi-node start does when the fabric probe finds it short: on plain TCP (NCCL's sockets,
    gloo) or below half its instance type's expected bus bandwidth (clouds/fabric_rates.py). `warn`
    (default): a warning in the log, the `fabric` event, `status` and `cost-report`, and training goes on.
    `best`: the start refuses in one line with the measured and expected figures (exit 2). Warn by default
    because a refusal costs a whole restart, on new machines, where the fabric may simply be one the table
    does not name; `best` is for those who know their candidates' fabric (docs/clouds.md, "The fabric probe")."""
    probe_mib: Optional[int] = Field(None, ge=0, le=4096)
    """The probe's all-reduce buffer per rank in MiB (default: 256 on GPUs, 4 on CPU ranks); 0: no probe
    (the transport is still recorded and judged)."""


class Recipe(_Section):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    """Recipe name (lowercase letters, digits, hyphens)."""
    description: Text = Field("", max_length=500)
    """One line: what this recipe trains."""
    model: ModelSection
    data: DataSection
    train: TrainSection
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    resources: ResourcesSection
    storage: StorageSection = Field(default_factory=StorageSection)
    export: ExportSection = Field(default_factory=ExportSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    resilience: ResilienceSection = Field(default_factory=ResilienceSection)
    fabric: FabricSection = Field(default_factory=FabricSection)

    @model_validator(mode="after")
    def _held_out_set(self) -> "Recipe":
        if self.data.eval_split is not None and self.eval.fraction is not None:
            raise ValueError(
                "set one of data.eval_split and eval.fraction: both name the held-out set "
                "(eval.fraction=null unsets a recipe's fraction)"
            )
        if (self.eval.every_steps or self.eval.every_seconds) and not self.has_eval:
            raise ValueError("eval.every_steps/every_seconds need a held-out set: data.eval_split or eval.fraction")
        return self

    @property
    def has_eval(self) -> bool:
        """The recipe evaluates (a held-out set is named)."""
        return self.data.eval_split is not None or self.eval.fraction is not None

    @model_validator(mode="after")
    def _elastic_needs_a_store(self) -> "Recipe":
        if self.resources.fewest_nodes < self.resources.num_nodes and not self.storage.store:
            raise ValueError(
                "resources.min_nodes below resources.num_nodes needs storage.store: a resume on fewer "
                "nodes reads the missing nodes' checkpoint parts from it"
            )
        return self

    @model_validator(mode="after")
    def _consistent_training(self) -> "Recipe":
        data, model = self.data, self.model
        if data.source == "synthetic" and data.format != "text":
            raise ValueError(f"data.format={data.format} needs records; the synthetic source is token ids")
        if data.format == "chat" and model.tokenizer == "bytes":
            raise ValueError("data.format=chat needs a tokenizer with a chat template; the byte tokenizer has none")
        if self.train.lora is not None and model.config is not None:
            raise ValueError(
                "train.lora adapts a pretrained model (model.hub_id); model.config builds one from "
                "scratch, which a full fine-tune trains"
            )
        if self.export.merge and self.train.lora is None:
            raise ValueError("export.merge needs train.lora: a full fine-tune's final/ is the whole model already")
        return self

    def fingerprint(self) -> str:
        """A short hash of what determines the training trajectory (not where it runs)."""
        keyed = self.model_dump(include={"model", "data", "train", "deepspeed"})
        if keyed["data"].get("eval_split") is None:
            keyed["data"].pop("eval_split", None)  # (the fingerprints of recipes without one stay as they were)
        if self.eval.fraction is not None:  # held out of training: another trajectory
            keyed["eval_fraction"] = self.eval.fraction
        return hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- loading


def recipe_path(name_or_path: str) -> Path:
    """Resolve a registry name or a path the user gave; nothing else."""
    if name_or_path in REGISTRY:
        return RECIPES_DIR / REGISTRY[name_or_path]
    looks_like_path = os.sep in name_or_path or name_or_path.endswith((".yaml", ".yml"))
    if looks_like_path:
        path = Path(name_or_path)
        if not path.is_file():
            raise UsageError(f"recipe file '{name_or_path}' not found")
        return path
    close = difflib.get_close_matches(name_or_path, REGISTRY, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise UsageError(f"unknown recipe '{name_or_path}'{hint}; `skyspot recipes` lists them")


def _key_lines(text: str) -> dict[str, int]:
    """Map dotted key paths to their 1-based line in the YAML text (for error messages)."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                path = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
                lines[path] = key_node.start_mark.line + 1
                walk(value_node, path)

    try:
        walk(yaml12.compose(text), "")
    except yaml.YAMLError:
        pass
    return lines


def _too_big(data: Any, budget: int = MAX_RECIPE_NODES) -> bool:
    """Whether `data` expands to more than `budget` values (aliases counted each time they are used)."""
    stack, seen = [data], 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > budget:
            return True
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple, set)):
            stack.extend(node)
    return False


# The one YAML reading of a recipe file and of an override's value (the CLI's and the trainer's) is
# yaml12.load: YAML 1.2's core schema, so `010` is 10, `yes` a string, `1:30` no number, `3e-4` a
# float, a date text, and a key (or the merge key `<<`) given twice an error with its line.


def _parse_value(raw: str, where: str = "") -> Any:
    """An override's value as YAML reads it; text that is no YAML stays the text it is."""
    try:
        value = yaml12.load(raw) if raw != "" else ""
    except yaml12.DuplicateKey as err:
        raise UsageError(f"{where or repr(raw)}: {err.problem}") from None
    except (yaml.YAMLError, RecursionError):
        return raw
    return raw if _too_big(value, 10_000) else value


# An override's key: `section.key` in lowercase, the form every recipe key has. The command line's
# `key=value` and the environment's SKYSPOT_SECTION__KEY pass this one rule, here and in the trainer.
_KEY = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*")


def parse_overrides(pairs: Sequence[str]) -> list[tuple[str, Any]]:
    """`section.key=value` strings -> (dotted key, parsed value)."""
    parsed = []
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not _KEY.fullmatch(key):
            raise UsageError(f"override '{pair}' is not of the form section.key=value (e.g. train.steps=40)")
        parsed.append((key, _parse_value(raw, f"override '{pair}'")))
    return parsed


def _env_key(name: str) -> Optional[str]:
    """The dotted key an environment variable sets (SKYSPOT_TRAIN__STEPS -> train.steps), or None
    when it is no override; one that would give a key no override can have is refused."""
    if not is_override_variable(name):
        return None
    key = name[len(ENV_PREFIX) :].lower().replace("__", ".")
    if not _KEY.fullmatch(key):
        raise UsageError(
            f"environment variable {name} is not of the form SKYSPOT_SECTION__KEY (letters, digits "
            f"and '_' only, e.g. SKYSPOT_TRAIN__STEPS): it would set '{key}', which the trainer's "
            "override parser refuses; rename or unset it"
        )
    return key


def is_override_variable(name: str) -> bool:
    """Whether an environment variable is a recipe override (SKYSPOT_<SECTION>__<KEY>), checked or not."""
    return name.startswith(ENV_PREFIX) and "__" in name


def env_overrides(environ: Mapping[str, str]) -> list[tuple[str, Any]]:
    """SKYSPOT_<SECTION>__<KEY>=value environment variables, as overrides."""
    found = []
    for name, raw in sorted(environ.items()):
        key = _env_key(name)
        if key is not None:
            found.append((key, _parse_value(raw, f"environment variable {name}")))
    return found


def override_texts(
    overrides: Sequence[str] = (), *, environ: Mapping[str, str], flags: Optional[Mapping[str, Any]] = None
) -> dict[str, str]:
    """Every value set on top of the recipe file, as dotted key -> `key=value` text that
    `parse_overrides` reads back to the same value: the environment's, then the command line's,
    then the flags' (the precedence of `load_recipe`; a later source replaces an earlier one's
    value and keeps its place). The environment's and the command line's text as the user wrote it."""
    texts: dict[str, str] = {}
    for name, raw in sorted(environ.items()):
        key = _env_key(name)
        if key is not None:
            texts[key] = f"{key}={raw}"
    for pair in overrides:
        key, _, raw = pair.partition("=")
        texts[key.strip()] = f"{key.strip()}={raw}"
    for key, value in (flags or {}).items():
        if value is not None:
            texts[key] = f"{key}={value_text(value)}"
    return texts


def value_text(value: Any) -> str:
    """A value as override text that `parse_overrides` reads back to it, a flag's or a resolved one
    (`[aws, gcp]`, `false`, a string as is when it reads back as itself)."""
    if isinstance(value, str) and _parse_value(value) == value:
        return value
    return yaml12.dump_flow(value)


def _apply(data: dict[str, Any], key: str, value: Any, source: str, problems: list[str]) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            problems.append(f"{source} '{key}': '{part}' is not a section")
            return
        node = child
    node[parts[-1]] = value


def _check_override_keys(overrides: list[tuple[str, Any]], source: str, problems: list[str]) -> None:
    for key, _ in overrides:
        if not _field_exists(Recipe, key.split(".")):
            top = key.split(".")[0]
            candidates = [f"{top}.{f}" for f in _section_fields(top)] or list(Recipe.model_fields)
            close = difflib.get_close_matches(key, candidates, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            problems.append(f"{source} '{key}' names no recipe key{hint}")


def _section_fields(section: str) -> list[str]:
    field = Recipe.model_fields.get(section)
    model = getattr(field, "annotation", None) if field else None
    return list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []


def _field_exists(model: type[BaseModel], parts: list[str]) -> bool:
    field = model.model_fields.get(parts[0])
    if field is None:
        return False
    if len(parts) == 1:
        return True
    annotation = field.annotation
    inner = [a for a in getattr(annotation, "__args__", ()) if isinstance(a, type) and issubclass(a, BaseModel)]
    if len(inner) == 1:  # Optional[Section] (train.lora)
        annotation = inner[0]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _field_exists(annotation, parts[1:])
    # Free-form dicts (model.config, deepspeed.extra) accept any sub-key.
    return "dict" in str(annotation)


def load_recipe(
    name_or_path: str,
    overrides: Sequence[str] = (),
    *,
    environ: Optional[Mapping[str, str]] = None,
    flags: Optional[Mapping[str, Any]] = None,
) -> Recipe:
    """Load, merge (flags > command line > env > file > defaults) and validate a recipe. Raises
    RecipeError with every problem."""
    path = recipe_path(name_or_path)
    source = str(path) if name_or_path not in REGISTRY else f"recipes/{REGISTRY[name_or_path]}"
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_RECIPE_BYTES + 1)
    except OSError as err:
        raise UsageError(f"cannot read recipe '{path}': {err.strerror or err}") from None
    if len(raw) > MAX_RECIPE_BYTES:
        raise RecipeError(
            source, [f"the file is larger than {MAX_RECIPE_BYTES >> 10} KiB; a recipe is a short YAML file"]
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RecipeError(source, [f"not UTF-8 text (byte {err.start})"]) from None
    try:
        data = yaml12.load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise RecipeError(where, [f"malformed YAML: {problem}"]) from None
    except RecursionError:
        raise RecipeError(source, ["malformed YAML: nested too deeply"]) from None
    if not isinstance(data, dict):
        raise RecipeError(source, ["a recipe must be a YAML mapping of sections"])
    if _too_big(data):
        raise RecipeError(
            source,
            [f"more than {MAX_RECIPE_NODES} values once YAML aliases are expanded (or an alias that refers to itself)"],
        )

    problems: list[str] = []
    env_pairs = env_overrides(environ if environ is not None else os.environ)
    cli_pairs = parse_overrides(overrides)
    _check_override_keys(env_pairs, "environment override", problems)
    _check_override_keys(cli_pairs, "override", problems)
    flag_pairs = [(k, v) for k, v in (flags or {}).items() if v is not None]
    origins = _origins(env_pairs, environ if environ is not None else os.environ, cli_pairs, overrides, flag_pairs)
    if not problems:
        for key, value in env_pairs:
            _apply(data, key, value, "environment override", problems)
        for key, value in cli_pairs:
            _apply(data, key, value, "override", problems)
        for key, value in flag_pairs:
            _apply(data, key, value, "flag", problems)
    if problems:
        raise RecipeError(source, problems)

    if data and not set(map(str, data)) & set(Recipe.model_fields):
        # Not a recipe at all (a config, /etc/shadow): said without echoing a line of it.
        raise RecipeError(
            source,
            [
                f"not a recipe: none of its {len(data)} top-level key(s) is a recipe section "
                f"({', '.join(Recipe.model_fields)})"
            ],
        )
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        try:
            lines = _key_lines(text)
        except RecursionError:
            lines = {}
        for error in err.errors():
            loc = ".".join(str(p) for p in error["loc"] if not isinstance(p, int))
            message = error["msg"].removeprefix("Value error, ")
            if error["type"] == "extra_forbidden":
                message = "unknown key"
            elif error["type"] == "missing":
                message = "required key is missing"
            elif error["type"] in ("literal_error", "enum") and "input" in error:
                message = f"{message} (got {error['input']!r})"
            elif error["type"] in _STRICT_TYPES and "input" in error:
                # Strict: `true` is no step count and `5.0` or " 5 " no integer; say what was read.
                message = f"{message}, not {_kind(error['input'])} {_shown(error['input'])}"
            origin = _origin_of(loc, origins)
            if origin is not None:  # the user's override set this value, not the file
                problems.append(f"{origin}: {message}")
                continue
            line = lines.get(loc)
            # A key is named only when it looks like one: a file's line is never echoed whole.
            shown = loc if _KEY_PATH.fullmatch(loc or "") else ("a key" if loc else "(top)")
            problems.append(f"{shown}{f' (line {line})' if line else ''}: {message}")
        if all(p.startswith(("override ", "environment ", "flag ")) for p in problems):
            raise RecipeError(None, [*problems[:-1], f"{problems[-1]} (recipe {source})"]) from None
        raise RecipeError(source, problems) from None


_KEY_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}(\.[A-Za-z_][A-Za-z0-9_-]{0,63}){0,7}")

_STRICT_TYPES = ("int_type", "float_type", "bool_type", "string_type", "list_type", "dict_type", "model_type")


def _kind(value: Any) -> str:
    return {
        bool: "the boolean",
        int: "the integer",
        float: "the number",
        str: "the string",
        list: "the list",
        dict: "the mapping",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    if value is None:
        return ""
    text = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _origins(
    env_pairs: Sequence[tuple[str, Any]],
    environ: Mapping[str, str],
    cli_pairs: Sequence[tuple[str, Any]],
    overrides: Sequence[str],
    flag_pairs: Sequence[tuple[str, Any]],
) -> dict[str, str]:
    """Dotted key -> how the user set it (`override train.steps=abc`), the winning source last."""
    found: dict[str, str] = {}
    env_raw = {_env_key(name): (name, raw) for name, raw in environ.items() if _env_key(name) is not None}
    for key, _ in env_pairs:
        name, raw = env_raw.get(key, (key, ""))
        found[key] = f"environment {name}={raw}"
    for (key, _), pair in zip(cli_pairs, overrides):
        found[key] = f"override {pair.strip()}"
    for key, value in flag_pairs:
        found[key] = f"flag {key}={value}"
    return {key: text if len(text) <= 120 else text[:117] + "..." for key, text in found.items()}


def _origin_of(loc: str, origins: dict[str, str]) -> Optional[str]:
    """The override that set `loc` or a section above it, if one did."""
    parts = loc.split(".") if loc else []
    for end in range(len(parts), 0, -1):
        origin = origins.get(".".join(parts[:end]))
        if origin is not None:
            return origin
    return None


def list_recipes() -> list[Recipe]:
    """Every registry recipe, validated (used by `skyspot recipes`)."""
    return [load_recipe(name, environ={}) for name in REGISTRY]
