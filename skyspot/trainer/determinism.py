"""Determinism: threads, seeds, RNG capture and restore, and what makes resume bitwise exact.

Two runs of the same recipe on the same hardware and world size agree bitwise, and a run resumed
from a checkpoint in a fresh process continues bitwise as if never stopped. What that takes:

- the same intra-op thread count (set explicitly here): a CPU reduction splits its work by
  thread count, and a different split rounds differently;
- every RNG state restored per rank: Python, NumPy, torch (CPU and accelerator);
- the data order a pure function of (seed, epoch, position), nothing stateful (data.py);
- the optimizer. This one was the ~1-ulp drift: DeepSpeed's C++ Adam kernels (FusedAdam on the
  CPU accelerator, DeepSpeedCPUAdam under ZeRO-Offload) keep beta1^t and beta2^t for the bias
  correction as float running products inside a process-global C++ object (`Adam_Optimizer::
  IncrementStep` in csrc/includes/cpu_adam.h: `_betta1_t *= _betta1` each step). A fresh
  process cannot restore that object; on its first step it recomputes `std::pow(beta1, step)`,
  which differs from the accumulated product in the last bits at many steps (e.g. 3, 6, 9, 12,
  14, 16, 19 and nearly every step after 19 for beta=0.9/0.999), so every parameter ends a float32
  ulp or so away. Two fixes, both applied:
    * by default the trainer uses torch's AdamW (DeepSpeed `torch_adam`), whose bias correction
      is computed from the step count each step, so there is no hidden state to lose (and no JIT
      build of the C++ op);
    * when a DeepSpeed C++ Adam is in use anyway (offload, or chosen through deepspeed.extra),
      `replay_adam_bias_correction` re-runs the C++ step counter 1..t on a one-element dummy
      tensor after loading, so beta^t is rebuilt by exactly the same sequence of float
      multiplications as in the uninterrupted run. It costs about 4 us per past step here (0.4 s
      for 100,000 steps).
  Adam's `step` itself is restored with its own type (int in DeepSpeed's optimizers, a float32
  tensor in torch's), lr and betas as the python floats that were saved; the LR schedule is
  recomputed from the restored step count, never accumulated.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch


def configure_threads(local_world_size: int) -> int:
    """Pin torch's intra-op thread count (OMP_NUM_THREADS if set, else cores / local ranks)."""
    raw = os.environ.get("OMP_NUM_THREADS", "").strip()
    threads = int(raw) if raw.isdigit() and int(raw) > 0 else max(1, (os.cpu_count() or 1) // max(1, local_world_size))
    torch.set_num_threads(threads)
    return threads


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_for_resume(seed: int, rank: int, step: int) -> None:
    """After a resume at another world size the saved per-rank RNG states have no owner:
    re-seed each rank from (seed, rank, step) instead, the same on every such resume."""
    seed_everything(seed + 1000 * rank + 1_000_003 * step)


def capture_rng() -> dict[str, Any]:
    """Every RNG state of this process (copies, safe to save later)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _loaded_step(optimizer) -> int:
    steps = [s.get("step") for s in optimizer.state.values() if isinstance(s, dict) and "step" in s]
    steps = [int(s.item()) if isinstance(s, torch.Tensor) else int(s) for s in steps if s is not None]
    return max(steps, default=0)


def replay_adam_bias_correction(optimizer) -> int:
    """Rebuild the C++ Adam's beta^t running products after a load; returns the steps replayed.

    `optimizer` is the basic optimizer (engine.optimizer.optimizer under ZeRO). A no-op for
    optimizers without that hidden state (torch's AdamW, FusedAdam on CUDA, which computes
    beta^t from the step each call).
    """
    step = _loaded_step(optimizer)
    if step <= 0 or not optimizer.param_groups:
        return 0
    group = optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    dummy = [torch.zeros(1, dtype=torch.float32) for _ in range(4)]  # param, grad, exp_avg, exp_avg_sq
    name = type(optimizer).__name__
    if name == "FusedAdam" and hasattr(optimizer, "multi_tensor_adam") and not torch.cuda.is_available():
        for s in range(1, step + 1):
            optimizer.multi_tensor_adam(
                2048 * 32,
                optimizer._dummy_overflow_buf,
                [[dummy[1]], [dummy[0]], [dummy[2]], [dummy[3]]],
                group["lr"],
                beta1,
                beta2,
                group["eps"],
                s,
                optimizer.adam_w_mode,
                1 if group.get("bias_correction", True) else 0,
                group["weight_decay"],
            )
        return step
    if hasattr(optimizer, "ds_opt_adam") and hasattr(optimizer, "opt_id"):  # DeepSpeedCPUAdam
        for s in range(1, step + 1):
            optimizer.ds_opt_adam.adam_update(
                optimizer.opt_id,
                s,
                group["lr"],
                beta1,
                beta2,
                group["eps"],
                group["weight_decay"],
                group.get("bias_correction", True),
                dummy[0],
                dummy[1],
                dummy[2],
                dummy[3],
            )
        return step
    return 0
