"""Task: render a recipe into a SkyPilot managed-job task (YAML for SkyPilot 0.14).

The rendered task is the contract between skyspot and both executors: SkyPilot runs
it on clouds, the local executor runs the same `run` script on this machine. It:

- lists every candidate in `resources.ordered` (spot first, cheapest first; planning/candidates.py),
  with one `job_recovery` for all (SkyPilot rejects candidates whose recovery differs);
- recovers on the trainer's "preempted, checkpoint saved" exit code (75), never 137;
- ships skyspot itself: the wheel `launch` builds from the running skyspot (task/package.py) is
  mounted at PACKAGE_MOUNT and `setup` installs exactly that file and its stack for the node's
  own interpreter and driver (node_env.py), from the run's wheelhouse after the first start,
  then prepares what the trainer would otherwise build on its first start;
- mounts a data source that lives in a bucket (a streaming read is what a mount does well);
- mounts the run's store (a bucket): setup reads the run's wheelhouse there before skyspot is
  installed, and for a hub model the first start keeps a copy of the base model in
  `<store>/<run id>/base/` and every later start reads it there, in the bucket's region, instead
  of downloading it from the hub again (trainer/base.py). Checkpoints
  are never written through the mount: the trainer writes them through the cloud SDK and counts
  one durable only once its remote commit marker exists;
- names the run: SKYSPOT_RUN_NAME is the managed job's name, the ledger's name and the
  store prefix (unset in a task rendered without a name: the node then uses SkyPilot's
  SKYPILOT_TASK_ID, unique per job and stable across its recoveries);
- hands the node its recipe values through one channel, the trainer's command line: the recipe
  (a registry name, or the user's file mounted at RECIPE_MOUNT) and, as `section.key=value`
  overrides, every value set on top of it at launch (environment, command line, flags such as
  `--store`), the run's store first (`storage.store=URI`) whatever set it. The command line, not
  an environment variable: SkyPilot reruns the same `run` after every recovery and the local
  executor runs it as is, the trainer parses overrides exactly as the CLI does (recipe.py), and
  `key=value` words need no second encoding; each is shell-quoted, so a value is one inert word.
  No secret enters them: a recipe holds none;
- passes HF_TOKEN (and the dashboards' WANDB_API_KEY, MLFLOW_TRACKING_TOKEN) through `secrets:` with no
  value in the file;
- starts the trainer on every node under torchrun through skyspot's supervisor,
  which forwards SIGTERM and passes the trainer's exit code through torchrun.

No secret value is ever written here; launch adds them to the in-memory sky.Task.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import yaml

from skyspot import __version__
from skyspot.task.package import NODE_EXTRAS, PACKAGE_MOUNT, PLACEHOLDER, Package
from skyspot.planning.candidates import Candidate
from skyspot.recipe import Recipe
from skyspot.start_bounds import start_bounds
from skyspot.storage import is_bucket_uri, mount_source, parse_store_uri
from skyspot.wheelhouse import KEY_ENV as WHEELHOUSE_KEY_SECRET

from skyspot.trainer.exit_codes import PREEMPTED as RECOVER_EXIT_CODE  # one definition; import-light (errors only)
from skyspot.trainer.metrics.spot import PRICES_ENV  # the node's side of the price table
from skyspot.clouds.aws_images import IMAGES_ENV as EFA_IMAGES_ENV
from skyspot.trainer.nccl_env import FABRIC_ENV  # the node's side of the fabric table

# Where a node keeps the fast checkpoint tier and where a bucket data source is mounted.
NODE_RUNS_DIR = "$HOME/skyspot/runs"
DATA_MOUNT = "/skyspot/data"
STORE_MOUNT = "/skyspot/store"  # the run's store bucket; SKYSPOT_STORE_MOUNT names the store's root in it

# Distributed timeouts: a lost node must make the others fail fast, so SkyPilot recovers
# the job instead of paying for a hung cluster. Values in seconds.
DIST_ENV = {
    "SKYSPOT_DIST_TIMEOUT_SECONDS": "600",  # collective timeout passed to init_process_group
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # abort the communicator on a failed collective
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "300",  # watchdog kills a rank stuck in NCCL
    "TORCH_NCCL_ENABLE_MONITORING": "1",
    # How long torchrun's agents wait for every node at a rendezvous (the start, and each restart in place):
    # past it, the nodes that came exit with the error and SkyPilot recovers the cluster (a node that never
    # rejoins is lost).
    "SKYSPOT_RDZV_JOIN_TIMEOUT_SECONDS": "300",
}

# torchrun counts restarts over its whole life and knows no hour: its --max-restarts is the recipe's hourly
# budget (resilience.restarts_in_place) for a day, a ceiling for failures the trainer never gets to count
# (a crash before the ranks meet); the trainer keeps the budget itself (trainer/restart.py).
DAY_AT_FULL_RATE = 24


def torchrun_max_restarts(per_hour: int) -> int:
    """torchrun's --max-restarts for a budget of `per_hour` restarts in place (0: none, as before they existed)."""
    return per_hour * DAY_AT_FULL_RATE


JOB_RECOVERY = {
    # On preemption, try the next region first: the current one just ran out of spot capacity.
    "strategy": "EAGER_NEXT_REGION",
    "max_restarts_on_errors": 3,
    "recover_on_exit_codes": [RECOVER_EXIT_CODE],
}


def _resource_entry(candidate: Candidate, recipe: Recipe) -> dict[str, Any]:
    entry: dict[str, Any] = {"cloud": candidate.cloud}
    if candidate.region:
        entry["region"] = candidate.region
    if candidate.accelerators:
        entry["accelerators"] = candidate.accelerators
    elif recipe.resources.cpus:
        entry["cpus"] = recipe.resources.cpus
    entry["use_spot"] = candidate.spot
    image = _fabric_cloud(candidate, recipe)
    image = image.fabric_image(candidate.instance_type) if image else None
    if image:  # the fabric's user space (Azure ND: Microsoft's HPC image; clouds/azure.py)
        entry["image_id"] = image
    if candidate.network_tier:
        # Per candidate, not for all: on Azure SkyPilot has no network_tier and would drop the candidate.
        entry["network_tier"] = candidate.network_tier
    return entry


def _fabric_cloud(candidate: Candidate, recipe: Recipe):
    """The candidate's cloud when the recipe asks for the fast fabric (`network_tier: best`), else None."""
    if recipe.resources.network_tier != "best":
        return None
    from skyspot import clouds

    return clouds.get(candidate.cloud)


def fabric_envs(recipe: Recipe, candidates: Sequence[Candidate]) -> dict[str, dict[str, str]]:
    """{instance type: the variables NCCL needs on it} for the fabric candidates (each cloud's `fabric_env`).

    SkyPilot's `envs` are one set for all of `resources.ordered`, and EFA's, TCPX's and InfiniBand's settings
    differ (TCPX's NCCL_ALGO=Ring would slow an InfiniBand ring): the task carries the table as
    SKYSPOT_FABRIC_ENV and each node exports its own instance type's entry (trainer/nccl_env.py)."""
    table: dict[str, dict[str, str]] = {}
    for candidate in candidates:
        cloud = _fabric_cloud(candidate, recipe)
        env = cloud.fabric_env(candidate.instance_type) if cloud and candidate.instance_type else {}
        if env:
            table[str(candidate.instance_type)] = env
    return table


def _data_mount(uri: str) -> tuple[str, dict[str, Any], str]:
    """(mount point, SkyPilot mount, the data's path on the node) for a data source in a bucket."""
    parsed = parse_store_uri(uri)
    mount_point = f"{DATA_MOUNT}/{parsed.bucket}"
    return mount_point, {"source": mount_source(parsed), "mode": "MOUNT"}, f"{mount_point}/{parsed.prefix}"


def _store_mount(uri: str) -> tuple[str, dict[str, Any], str]:
    """(mount point, SkyPilot mount, the store's root on the node) for the run's store bucket."""
    parsed = parse_store_uri(uri)
    mount_point = f"{STORE_MOUNT}/{parsed.bucket}"
    root = f"{mount_point}/{parsed.prefix}" if parsed.prefix else mount_point
    return mount_point, {"source": mount_source(parsed), "mode": "MOUNT"}, root


def _data_source(source: str, file_mounts: dict[str, Any], *, local: bool, key: str = "data.source") -> list[str]:
    """The data.source override the node's trainer needs, adding a bucket source's mount on a cloud
    (`key` data.eval_split: the same for the held-out file of a file source).

    A bucket source is mounted on a cloud node and read there; the local executor has no bucket
    mounts, so a local run gets the URI itself and the trainer downloads it into the run directory
    first (trainer/resume.py `data_source`). A file on this machine goes as the absolute path the
    recipe resolved at launch: the trainer runs in the run directory, where a relative path would
    name another file."""
    if source == "synthetic" or source.startswith("hf://"):
        return []
    if is_bucket_uri(source):
        if local:
            return []  # the recipe's own value, which the trainer resolves the same way
        mount_point, mount, node_path = _data_mount(source)
        file_mounts[mount_point] = mount
        return [f"{key}={node_path}"]
    return [f"{key}={source}"]


# The secret an Azure Blob store needs on a node: SkyPilot's Azure VMs carry no identity that
# may read or write blobs, and nodes on other clouds have none at all (docs/storage.md).
AZURE_STORE_SECRET = "AZURE_STORAGE_KEY"


def _watchdog_flags(recipe: Recipe) -> str:
    """The supervisor's hang watchdog bounds (trainer/watchdog.py), from the recipe's `resilience`."""
    r = recipe.resilience
    if not r.watchdog:
        return " --no-watchdog"
    # At least what the I/O plan allows this recipe's first download (start_bounds.py): a slow start is not a hang.
    first_step = start_bounds(recipe).first_step_seconds
    return (
        f" --hang-factor {_exact(r.hang_factor)} --hang-floor {_exact(r.hang_floor_seconds)} "
        f"--first-step-bound {_exact(first_step)}"
    )


def _exact(value: float) -> str:
    """A number as the shell passes it on, exactly: 8100 -> '8100', 1.5 -> '1.5', never `:g`'s 1.23457e+06."""
    value = float(value)
    return str(int(value)) if value.is_integer() else repr(value)


# The dashboards' credentials (trainer/metrics/): W&B always needs its key; an MLflow server may need a
# token (passed when the launching environment has one: executors/sky/sdk.py OPTIONAL_SECRETS).
WANDB_SECRET = "WANDB_API_KEY"
MLFLOW_SECRET = "MLFLOW_TRACKING_TOKEN"


def metrics_secrets(recipe: Recipe) -> list[str]:
    """The secrets the recipe's metrics.backends need on the node."""
    backends = recipe.metrics.backends
    return ([WANDB_SECRET] if "wandb" in backends else []) + ([MLFLOW_SECRET] if "mlflow" in backends else [])


def node_extras(recipe: Recipe) -> list[str]:
    """The wheel's extras the node installs for the recipe's dashboards (package.NODE_EXTRAS, one per backend)."""
    return [name for name in NODE_EXTRAS if name in recipe.metrics.backends]


def candidate_prices(candidates: Sequence[Candidate]) -> str:
    """SKYSPOT_PRICES: each priced candidate's hourly price per node, compact JSON (trainer/metrics/spot.py)."""
    rows = [
        {
            "cloud": c.cloud,
            "region": c.region,
            "instance_type": c.instance_type,
            "accelerators": c.accelerators,
            "spot": c.spot,
            "usd_per_hour": c.usd_per_hour,
        }
        for c in candidates
        if c.usd_per_hour is not None
    ]
    return json.dumps(rows, separators=(",", ":"))


def run_script(recipe: Recipe, recipe_arg: str, trainer_overrides: Sequence[str]) -> str:
    """The `run` command every node executes (SkyPilot's and the local executor's).

    torchrun's c10d rendezvous, hosted by node 0's agent (`is_host`: on the local executor every node is
    127.0.0.1, and a guess from the address would let any node host it), restarts the workers of every
    node in place after a failure: the failed node's agent rejoins the rendezvous and the others see it
    waiting (`num_nodes_waiting`) and restart theirs. `--max-restarts` is only a ceiling: the trainer
    keeps the hourly budget and the backoff (trainer/restart.py); 0 restarts in place: none, as before.
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: each generation of workers gets a store of its own (the agent's
    shared one keeps the last generation's keys and a restarted group hangs, pytorch issue 135712).
    `--local_addr` is the node's own address, which the workers of the node torchrun numbers 0 reach;
    the trainer numbers the ranks by SKYPILOT_NODE_RANK itself (trainer/cluster.py pin_rank)."""
    quoted = " ".join(shlex.quote(o) for o in trainer_overrides)
    cpu_ranks = recipe.resources.cpu_ranks or 1
    restarts = torchrun_max_restarts(recipe.resilience.restarts_in_place)
    lines = [
        "set -eo pipefail",
        'export SKYSPOT_RUN_NAME="${SKYSPOT_RUN_NAME:-$SKYPILOT_TASK_ID}"',
        f'RUN_DIR="${{SKYSPOT_RUN_DIR:-{NODE_RUNS_DIR}/$SKYSPOT_RUN_NAME}}"',
        'MASTER_ADDR="$(echo "$SKYPILOT_NODE_IPS" | head -n1)"',
        'NODE_ADDR="$(echo "$SKYPILOT_NODE_IPS" | sed -n "$((SKYPILOT_NODE_RANK + 1))p")"',
        'IS_HOST=0; if [ "$SKYPILOT_NODE_RANK" = 0 ]; then IS_HOST=1; fi',
        'NPROC="${SKYPILOT_NUM_GPUS_PER_NODE:-0}"',
        f'if [ "$NPROC" -lt 1 ]; then NPROC={cpu_ranks}; fi',
        "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        *NODE_PYTHON,
        # A stage a deadline's controller launched make-before-break waits for the one it replaces (trainer/handover.py).
        f'if [ -n "${{SKYSPOT_HANDOVER:-}}" ]; then "$PY" -m skyspot.trainer.handover {shlex.quote(recipe_arg)}'
        + (f" {quoted}" if quoted else "")
        + "; fi",
        f'exec "$PY" -m skyspot.trainer.supervise --run-dir "$RUN_DIR"{_watchdog_flags(recipe)} -- \\',
        f'  "$PY" -m torch.distributed.run --nnodes "$SKYPILOT_NUM_NODES" --nproc_per_node "$NPROC" --max-restarts {restarts} \\',
        '  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:${SKYSPOT_MASTER_PORT:-29500}" --rdzv_id "$SKYSPOT_RUN_NAME" \\',
        '  --rdzv_conf "is_host=$IS_HOST,join_timeout=${SKYSPOT_RDZV_JOIN_TIMEOUT_SECONDS:-300}" \\',
        '  --local_addr "${NODE_ADDR:-$MASTER_ADDR}" \\',
        f'  -m skyspot.trainer {shlex.quote(recipe_arg)} --run-dir "$RUN_DIR"' + (f" {quoted}" if quoted else ""),
    ]
    return "\n".join(lines) + "\n"


# The interpreter node_env runs on before skyspot is installed: any Python 3.8 on (node_env.py and
# libpath.py are standard library only), the image's `python3` first. SkyPilot activates its own venv
# or conda's base before setup and run (sky/skylet/constants.py), and a custom Docker image such as
# GCP's TCPX container gets neither (sky/backends/backend_utils.py): whichever it is, it only bootstraps.
BOOTSTRAP_PYTHON = (
    'BOOT="$(command -v python3 || command -v python || true)"',
    'if [ -z "$BOOT" ]; then echo "skyspot node env: this image has no python3 or python to start setup with: '
    'use an image with one (docs/clouds.md)" >&2; exit 2; fi',
)
# GCP's GPUDirect-TCPX container (`network_tier: best` on a3-highgpu-8g; skyspot/clouds/gcp.py `fabric`): the host's
# boot script installs the driver and the TCPX NCCL plugin into folders the container mounts at
# /usr/local/nvidia/lib64 and /usr/local/tcpx/lib64, possibly after setup starts, and mounts them noexec.
# As SkyPilot's own example does (examples/gcp_gpu_direct_tcpx/nccl_tcpx_gcpvm_h100.yaml): wait for
# /usr/local/tcpx/lib64/libnccl.so.2 (bounded here: SKYSPOT_TCPX_WAIT_SECONDS, one line and exit 2 on
# timeout, never 75: a retry lands on the same broken image) and remount the folders exec. Unlike the
# example, torch's own libnccl serves (the installer's is older than the NCCL 2.29 torch 2.13 is built
# against): a folder of links to the plugin's files but its libnccl.so* goes first on LD_LIBRARY_PATH,
# and NCCL dlopens libnccl-net.so from there (NCCL's net plugin search: NCCL_NET_PLUGIN, else
# libnccl-net.so on the library path: NCCL's docs, "Environment Variables", NCCL_NET_PLUGIN; SkyPilot's
# example puts /usr/local/tcpx/lib64 on LD_LIBRARY_PATH for the same reason). The TCPX folder itself is then dropped (libpath.py).
# SKYSPOT_TCPX_ROOT (default /usr/local) exists for tests.
TCPX_SHIM = "$HOME/.skyspot/tcpx-lib"
TCPX_SETUP = (
    'TCPX="${SKYSPOT_TCPX_ROOT:-/usr/local}"',
    'if [ -d "$TCPX/tcpx/lib64" ]; then',
    '  waited=0; bound="${SKYSPOT_TCPX_WAIT_SECONDS:-900}"',
    '  while [ ! -f "$TCPX/tcpx/lib64/libnccl.so.2" ]; do',
    '    if [ "$waited" -ge "$bound" ]; then echo "skyspot node env: GPUDirect-TCPX is not installed on this node '
    "after ${bound}s ($TCPX/tcpx/lib64/libnccl.so.2 missing: the boot script of the host did not finish); "
    'docs/clouds.md" >&2; exit 2; fi',
    "    sleep 5; waited=$((waited + 5))",
    "  done",
    '  for d in "$TCPX/tcpx/lib64" "$TCPX/nvidia/lib64" "$TCPX/nvidia/bin"; do',
    '    if [ -d "$d" ]; then mount -o remount,exec "$d" 2>/dev/null || sudo -n mount -o remount,exec "$d" '
    '2>/dev/null || echo "skyspot node env: could not remount $d exec"; fi',
    "  done",
    f'  rm -rf "{TCPX_SHIM}"; mkdir -p "{TCPX_SHIM}"',
    '  for f in "$TCPX"/tcpx/lib64/*; do case "${f##*/}" in libnccl.so*) ;; *) ln -s "$f" '
    f'"{TCPX_SHIM}/";; esac; done',
    '  echo "skyspot node env: GPUDirect-TCPX plugin ready after ${waited}s; NCCL is the one torch ships, the plugin '
    f'is loaded from {TCPX_SHIM}"',
    f'else rm -rf "{TCPX_SHIM}"',
    "fi",
)


# skyspot's own venv, which node_env made and installed into (node_env.venv_path: $SKYSPOT_VENV, else
# ~/.skyspot/venv), by path: never conda's base or whatever `python` is first on PATH. SKYSPOT_PYTHON
# is the local executor's, which runs the trainer from its own environment unless the node is fresh.
# LD_LIBRARY_PATH loses its CUDA and NCCL folders: torch loads its own (libpath.py).
NODE_PYTHON = (
    'PY="${SKYSPOT_PYTHON:-${SKYSPOT_VENV:-$HOME/.skyspot/venv}/bin/python}"',
    f'if [ -d "{TCPX_SHIM}" ]; then LD_LIBRARY_PATH="{TCPX_SHIM}:${{LD_LIBRARY_PATH:-}}"; '
    f'export SKYSPOT_LIBPATH_KEEP="{TCPX_SHIM}"; fi',
    'LD_LIBRARY_PATH="$("$PY" -m skyspot.libpath)"; export LD_LIBRARY_PATH',
    # The fabric's NCCL variables for this node's instance type (trainer/nccl_env.py), after the clean-up, which
    # would drop the aws-ofi-nccl folder it puts first (and keeps through later clean-ups: SKYSPOT_LIBPATH_KEEP).
    f'if [ -n "${{{FABRIC_ENV}:-}}" ]; then eval "$("$PY" -m skyspot.trainer.nccl_env)"; fi',
)


# Runs once on every newly provisioned node (SkyPilot reruns it after each recovery onto a new VM). The package folder holds exactly one wheel: the
# build `launch` mounted. node_env runs from inside that wheel (skyspot is not installed yet): it
# picks the torch build the node's driver runs and installs the stack with uv, from the run's
# wheelhouse in the store (read through the bucket mount) when an earlier start left one, else
# from the index, leaving the wheelhouse for the next start (node_env.py).
def setup_script(
    store: Optional[str] = None, recipe_arg: str = "", trainer_overrides: Sequence[str] = (), extras: Sequence[str] = ()
) -> str:
    """The task's `setup`; `store` is the run's store, where the node keeps and finds its wheelhouse.

    `prepare` is given the trainer's own recipe and overrides (the words `run` passes after
    `-m skyspot.trainer`), so it builds the ops that recipe loads (DeepSpeedCPUAdam with
    `offload_optimizer: cpu`) and refuses a GPU node torch cannot use before any training starts.
    """
    store_arg = f" --store {shlex.quote(store)}" if store else ""
    store_arg += f" --extras {','.join(extras)}" if extras else ""  # the dashboards' libraries (metrics.backends)
    prepare_args = "".join(f" {shlex.quote(w)}" for w in ([recipe_arg] if recipe_arg else []) + list(trainer_overrides))
    return (
        "\n".join(
            [
                "set -e",
                'WHEEL="$(ls "$SKYSPOT_PACKAGE_DIR"/skyspot-*.whl)"',
                *TCPX_SETUP,
                *BOOTSTRAP_PYTHON,
                f'PYTHONPATH="$WHEEL" "$BOOT" -m skyspot.node_env setup --wheel "$WHEEL"{store_arg}',
                *NODE_PYTHON,
                f'if [ -n "${{{EFA_IMAGES_ENV}:-}}" ]; then "$PY" -m skyspot.trainer.nccl_env --check-image; fi',
                f'"$PY" -m skyspot.trainer.prepare{prepare_args}',
                # The fast tier on the instance's local NVMe, where it has one (trainer/local_disk.py): the run
                # directories go there and the disk is measured once; never fatal, a no-op off a SkyPilot node.
                f'"$PY" -m skyspot.trainer.local_disk --link "{NODE_RUNS_DIR}" || true',
            ]
        )
        + "\n"
    )


RECIPE_MOUNT = "/skyspot/recipe.yaml"


def render(
    recipe: Recipe,
    candidates: Sequence[Candidate],
    *,
    recipe_arg: str,
    recipe_file: Optional[str] = None,
    overrides: Sequence[str] = (),
    run_name: Optional[str] = None,
    package_dir: Optional[str] = None,
    local: bool = False,
) -> dict[str, Any]:
    """The task as a dict (what `to_yaml` prints and `sky.Task.from_yaml_config` reads).

    `candidates` are the plan's placements, in order (plan.candidates). `recipe_arg` is what the
    node passes to the trainer: a registry name, or (with `recipe_file`, the user's own recipe
    file) the path that file is mounted at. `overrides` are the values set on top of the recipe
    (launch.py); they reach the trainer as `key=value` arguments, shell-quoted, after the store's.
    `package_dir` is the folder of the wheel `launch` built (task/package.py); without it the mount
    shows a placeholder. `local`: the task is for the local executor, which mounts no bucket.
    """
    store = recipe.storage.store
    # The store reaches the trainer once, first, as the recipe resolved it (launch.py decides it).
    # (No store: the overrides that unset it go as they are, so the file's store cannot come back.)
    trainer_overrides = [f"storage.store={store}"] if store else []
    trainer_overrides += [o for o in overrides if not store or o.partition("=")[0].strip().split(".")[0] != "storage"]
    file_mounts: dict[str, Any] = {PACKAGE_MOUNT: package_dir or PLACEHOLDER}
    if recipe_file:
        file_mounts[recipe_arg] = recipe_file
    trainer_overrides += _data_source(recipe.data.source, file_mounts, local=local)
    if recipe.data.eval_split and not recipe.data.source.startswith("hf://"):
        trainer_overrides += _data_source(recipe.data.eval_split, file_mounts, local=local, key="data.eval_split")

    envs = {
        **({"SKYSPOT_RUN_NAME": run_name} if run_name else {}),
        "SKYSPOT_PACKAGE_DIR": PACKAGE_MOUNT,
        **DIST_ENV,
    }
    bucket_store = bool(store) and not parse_store_uri(store).is_local
    if bucket_store and not local:  # the wheelhouse (setup) and the base model's copy (trainer/base.py)
        mount_point, mount, store_root = _store_mount(store)
        file_mounts[mount_point] = mount
        envs["SKYSPOT_STORE_MOUNT"] = store_root
    task: dict[str, Any] = {
        "name": run_name or f"skyspot-{recipe.name}",
        "num_nodes": recipe.resources.num_nodes,
        "resources": {
            "disk_size": recipe.resources.disk_size,
            "job_recovery": dict(JOB_RECOVERY),
            "ordered": [_resource_entry(c, recipe) for c in candidates],
        },
        "envs": envs,
    }
    fabric = fabric_envs(recipe, candidates)
    if fabric:
        envs[FABRIC_ENV] = json.dumps(fabric, separators=(",", ":"), sort_keys=True)
    if recipe.metrics.backends:  # the node prices its own curve (trainer/metrics/spot.py; no pricing import there)
        envs[PRICES_ENV] = candidate_prices(candidates)
    secrets = {}
    if recipe.model.gated:
        secrets["HF_TOKEN"] = None
    if store and parse_store_uri(store).scheme == "az":
        secrets[AZURE_STORE_SECRET] = None
    if store:  # the run's key, which vouches for its wheelhouse in the store (wheelhouse.py); filled at submission
        secrets[WHEELHOUSE_KEY_SECRET] = None
    secrets.update(dict.fromkeys(metrics_secrets(recipe)))
    if secrets:
        task["secrets"] = secrets
    task["file_mounts"] = file_mounts
    task["setup"] = setup_script(store, recipe_arg, trainer_overrides, node_extras(recipe))
    task["run"] = run_script(recipe, recipe_arg, trainer_overrides)
    return task


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings as `|` blocks, so the run script reads as a script."""


def _str_presenter(dumper, data):
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_BlockDumper.add_representer(str, _str_presenter)


_ORDER = {"expected_cost": "by expected cost per hour of training", "price": "cheapest first"}
"""How the header says the candidates are ordered, by resources.placement (planning/candidates.py)."""


def to_yaml(task: dict[str, Any], recipe: Recipe) -> str:
    description = "".join(f"# {line}\n" for line in recipe.description.splitlines())  # never a raw line
    header = (
        f"# SkyPilot managed-job task rendered by skyspot {__version__} from recipe '{recipe.name}'.\n"
        f"{description}"
        f"# Candidates: spot first, then on-demand, each {_ORDER[recipe.resources.placement]} (price snapshot).\n"
        f"# Exit code {RECOVER_EXIT_CODE} = preempted with an emergency checkpoint committed: recover.\n"
    )
    secrets = list(task.get("secrets") or {})
    if secrets:
        flags = " ".join(f"--secret {name}" for name in secrets)
        header += (
            f"# Secrets are named here, never valued: `skyspot launch` passes them from your environment;\n"
            f"# with SkyPilot's CLI: sky jobs launch FILE {flags}\n"
        )
        if WHEELHOUSE_KEY_SECRET in secrets:
            header += (
                f"# ({WHEELHOUSE_KEY_SECRET}: the run's own key, which vouches for its wheelhouse; skyspot keeps\n"
                "# it in $SKYSPOT_HOME/keys/RUN. By hand: 64 hex digits you keep, e.g. `openssl rand -hex 32`.)\n"
            )
    return header + yaml.dump(task, Dumper=_BlockDumper, sort_keys=False, width=120)


@dataclass
class RenderedTask:
    """A run ready for an executor: the recipe as loaded once, its rendered task and YAML, the
    candidates planned once, and what the node gets on top of the recipe (launch.build makes it)."""

    recipe: Recipe
    recipe_arg: str
    task: dict[str, Any]
    yaml: str
    candidates: list[Candidate]
    trainer_overrides: list[str] = field(default_factory=list)
    """Values set on top of the recipe file (environment, command line, flags), for the node."""
    run_name: Optional[str] = None
    """The one name of the run: managed job, ledger row, the node's run id, the store prefix."""
    package: Optional[Package] = None
    """The skyspot wheel the nodes install (None: the task shows a placeholder)."""
