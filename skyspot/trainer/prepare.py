"""Prepare a fresh node once, in the task's `setup`, so the first training start does not stall.

    python -m skyspot.trainer.prepare

DeepSpeed compiles some of its ops on first use (just in time, with ninja): on CPU nodes the
shared-memory collective op that ZeRO-3's all-gathers use, which takes a minute or more.
Built here, during setup, it lands in torch's extension cache and every start of the trainer
(the first one and each recovery on the same node) loads it in milliseconds. The ops built
are the ones the trainer would build on this node's accelerator; nothing is built twice.
"""

from __future__ import annotations

import sys
import time


def build_ops() -> list[str]:
    """Build (or load from the cache) the DeepSpeed ops the trainer loads on this accelerator."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    built = []
    accelerator = get_accelerator()
    # The same check DeepSpeed's own comm backend makes before it loads the op (deepspeed/comm/torch.py).
    builder = accelerator.create_op_builder("ShareMemCommBuilder")
    if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        builder.load(verbose=False)
        built.append(builder.absolute_name())
    return built


def main() -> int:
    started = time.monotonic()
    print("skyspot prepare: loading DeepSpeed's ops, building any this machine lacks (a minute or more the "
          "first time)", flush=True)
    try:
        built = build_ops()
    except Exception as error:  # a failed build is not fatal: the trainer builds it again at start
        print(f"skyspot prepare: DeepSpeed op build failed ({error}); the trainer will build it on first start",
              file=sys.stderr)
        return 0
    names = ", ".join(built) or "none needed on this accelerator"
    print(f"skyspot prepare: DeepSpeed ops ready ({names}) in {time.monotonic() - started:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
