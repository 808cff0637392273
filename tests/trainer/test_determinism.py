"""The ulp drift behind inexact resumes, shown and fixed without torchrun.

DeepSpeed's C++ Adam keeps beta^t as a running float product inside the process. A fresh process
that loads the optimizer state recomputes it with pow() and drifts by an ulp; replaying the step
counter rebuilds the same product. Needs DeepSpeed's CPU FusedAdam op already built (the trainer
itself uses torch's AdamW and never builds it), so it is skipped on a machine without it.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap

import pytest

from tests.trainer.launch import REPO, trainer_env

SCRIPT = textwrap.dedent("""
    import sys, torch
    from deepspeed.ops.adam import FusedAdam
    from skyspot.trainer.determinism import replay_adam_bias_correction
    mode, path = sys.argv[1], sys.argv[2]
    def grad(s):
        return torch.sin(torch.arange(64, dtype=torch.float32) * (s + 1))
    if mode == "first":
        p = torch.nn.Parameter(torch.zeros(64)); opt = FusedAdam([p], lr=1e-2)
        for s in range(60):
            if s == 30:
                torch.save({"p": p.detach().clone(), "opt": opt.state_dict()}, path + ".mid")
            p.grad = grad(s); opt.step()
        torch.save(p.detach().clone(), path + ".full")
    else:
        saved = torch.load(path + ".mid", weights_only=False)
        p = torch.nn.Parameter(saved["p"]); opt = FusedAdam([p], lr=1e-2)
        opt.load_state_dict(saved["opt"])
        if mode == "replay":
            assert replay_adam_bias_correction(opt) == 30
        for s in range(30, 60):
            p.grad = grad(s); opt.step()
        torch.save(p.detach().clone(), path + "." + mode)
""")


def _fused_adam_built() -> bool:
    """Built, and no build in progress (a `lock` file would make the load wait for it)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/torch_extensions"))
    built = glob.glob(os.path.join(root, "*", "fused_adam", "fused_adam*.so"))
    return bool(built) and not any(os.path.exists(os.path.join(os.path.dirname(so), "lock")) for so in built)


@pytest.mark.slow
@pytest.mark.skipif(not _fused_adam_built(), reason="DeepSpeed's CPU FusedAdam op is not built here")
def test_replaying_the_step_counter_makes_a_fresh_process_resume_bitwise(tmp_path):
    import torch

    base = str(tmp_path / "adam")

    def run(mode):
        return subprocess.Popen(
            [sys.executable, "-c", SCRIPT, mode, base],
            cwd=REPO,
            env=trainer_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    assert run("first").wait(300) == 0
    assert [p.wait(300) for p in [run("plain"), run("replay")]] == [0, 0]  # fresh processes, in parallel
    full = torch.load(base + ".full")
    assert not torch.equal(torch.load(base + ".plain"), full)  # the drift, in a fresh process
    assert torch.equal(torch.load(base + ".replay"), full)
