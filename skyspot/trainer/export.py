"""final/: the trained model as a Hugging Face directory (config.json + safetensors + tokenizer).

    AutoModelForCausalLM.from_pretrained(DIR/final)

ZeRO-3 parameters are gathered one module at a time onto global rank 0 (every rank must call
`export_final`); rank 0 writes into a temporary sibling directory and renames it into place, so
a kill during the export never leaves a half-written final/.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch

from skyspot.trainer.files import fsync_dir

FINAL = "final"


def gathered_state_dict(engine) -> dict[str, torch.Tensor]:
    """The full state dict on global rank 0 (empty elsewhere)."""
    if engine.zero_optimization_partition_weights():
        return engine._zero3_consolidated_16bit_state_dict() or {}
    if engine.global_rank == 0:
        return {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    return {}


def export_final(engine, tokenizer, run_dir: Path, *, is_writer: bool) -> Path | None:
    state = gathered_state_dict(engine)  # collective
    if not is_writer:
        return None
    target = Path(run_dir) / FINAL
    tmp = Path(run_dir) / f".{FINAL}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    engine.module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    for path in tmp.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(tmp)
    if target.exists():
        old = Path(run_dir) / f".{FINAL}.old-{int(time.time())}"
        os.replace(target, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, target)
    fsync_dir(run_dir)
    return target
