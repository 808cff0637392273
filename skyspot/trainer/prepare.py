"""Prepare a fresh node once, in the task's `setup`, so the first training start does not stall.

    python -m skyspot.trainer.prepare [RECIPE [key=value ...]]

First, on a node SkyPilot gave GPUs (SKYPILOT_SETUP_NUM_GPUS_PER_NODE, or the run's
SKYPILOT_NUM_GPUS_PER_NODE): torch must see CUDA and a device per GPU, else one line (driver,
torch's CUDA line, devices seen) and exit 2, so setup fails before a GPU-hour goes to training on
the CPU (gpu.py).

Then DeepSpeed's ops: DeepSpeed compiles some on first use (just in time, with ninja): on CPU nodes
the shared-memory collective op that ZeRO-3's all-gathers use, and, for a recipe with
`deepspeed.offload_optimizer: cpu`, DeepSpeedCPUAdam (the optimizer ZeRO-Offload runs on the host).
Built here, during setup, they land in torch's extension cache and every start of the trainer (the
first one and each recovery on the same node) loads them in milliseconds. The ops built are the ones
the trainer would build on this node's accelerator; nothing is built twice. The recipe is the one
the trainer gets (a registry name or the mounted file, and the same overrides); without one, only
the ops every recipe needs.

Last, one line of the node's facts (node_facts.py): Python, driver, torch, the NCCL file loaded, GPUs.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional

from skyspot.trainer.exit_codes import USAGE

COMM_OP = "ShareMemCommBuilder"  # what DeepSpeed's comm backend loads on CPU (deepspeed/comm/torch.py)
CPU_ADAM_OP = "CPUAdamBuilder"  # what DeepSpeedCPUAdam loads (deepspeed/ops/adam/cpu_adam.py)


def ops_for(recipe) -> list[str]:
    """The op builders a start of this recipe loads (None: those every recipe needs). Pure."""
    ops = [COMM_OP]
    if recipe is not None and recipe.deepspeed.offload_optimizer == "cpu":
        ops.append(CPU_ADAM_OP)
    return ops


def build_ops(recipe=None) -> list[str]:
    """Build (or load from the cache) the DeepSpeed ops the trainer loads on this accelerator."""
    from skyspot.trainer.lean_imports import import_deepspeed

    deepspeed = import_deepspeed()  # first, as the trainer imports it (lean_imports.py)
    from deepspeed.accelerator import get_accelerator

    built = []
    accelerator = get_accelerator()
    for name in ops_for(recipe):
        # The same check DeepSpeed makes before it loads an op: a builder this accelerator has, and
        # compatible here (deepspeed/comm/torch.py for the comm op).
        builder = accelerator.create_op_builder(name)
        if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            builder.load(verbose=False)
            built.append(builder.absolute_name())
    return built


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m skyspot.trainer.prepare",
        description="Check CUDA on a GPU node and build the DeepSpeed ops a start loads.",
    )
    parser.add_argument("recipe", nargs="?", metavar="RECIPE", help="the trainer's recipe (registry name or file)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="the trainer's recipe overrides")
    return parser.parse_intermixed_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    from skyspot.errors import UsageError
    from skyspot.trainer.gpu import require_cuda

    args = parse_args(argv)
    try:
        require_cuda()
        recipe = None
        if args.recipe:
            from skyspot.recipe import load_recipe

            recipe = load_recipe(args.recipe, args.overrides)
    except UsageError as err:
        print(f"skyspot prepare: {err}", file=sys.stderr, flush=True)
        return USAGE
    started = time.monotonic()
    from skyspot.trainer.ext_lock import clear_stale

    clear_stale(say=lambda line: print(f"skyspot prepare: {line}", flush=True))  # a killed build's lock (ext_lock.py)
    print(
        "skyspot prepare: loading DeepSpeed's ops, building any this machine lacks (a minute or more the first time)",
        flush=True,
    )
    try:
        built = build_ops(recipe)
    except Exception as error:  # a failed build is not fatal: the trainer builds it again at start
        print(
            f"skyspot prepare: DeepSpeed op build failed ({error}); the trainer will build it on first start",
            file=sys.stderr,
        )
        _say_node()
        return 0
    names = ", ".join(built) or "none needed on this accelerator"
    print(f"skyspot prepare: DeepSpeed ops ready ({names}) in {time.monotonic() - started:.1f}s", flush=True)
    _say_node()
    return 0


def _say_node() -> None:
    """The node's facts in one line, as the trainer's `node` event will carry them (node_facts.py): the
    setup log says which Python, torch, NCCL file and GPUs the node ended with."""
    from skyspot.trainer.node_facts import collect, summary_line

    try:
        print(f"skyspot prepare: {summary_line(collect())}", flush=True)
    except Exception as error:  # noqa: BLE001 - a fact that cannot be read never fails setup
        print(f"skyspot prepare: node facts not read ({error})", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
