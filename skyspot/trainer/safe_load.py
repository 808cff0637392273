"""Loading a checkpoint file without running what it pickles: `torch.load(weights_only=True)` and the
few classes a skyspot checkpoint really holds.

A checkpoint comes back from the store, and anyone who can write to the bucket can rewrite its files
and the manifest whose sha256 vets them (both sit in the same bucket): a checksum there proves the
file is whole, not that we wrote it. A full unpickler runs whatever callable the file names (an
`os.system` in a `__reduce__`) on every node that resumes. PyTorch's weights-only unpickler builds
only tensors, containers and the globals allowed here, and refuses the rest before calling anything.

What DeepSpeed 0.19.8's ZeRO-3 files and our own trainer state pickle, read with pickletools from a
real checkpoint (tests/trainer/test_safe_load.py lists and checks them):
- `zero_pp_rank_R_mp_rank_00_model_states.pt`: tensors, `torch.Size`, OrderedDict: the defaults suffice;
- `..._optim_states.pt`: the loss scaler object (`LossScaler`, or `DynamicLossScaler` with fp16) and
  `ZeroStageEnum`;
- `trainer_state_rank_R.pt`: RNG states, numpy's as an ndarray (`_reconstruct`, `ndarray`, `dtype`).
The same with `deepspeed.bf16: true` (bf16 storages, `bf16_zero_pp_rank_R_..._optim_states.pt`);
`DynamicLossScaler` is what fp16 saves instead of `LossScaler` (DeepSpeed's runtime/fp16/loss_scaler.py).
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from skyspot.errors import CheckpointError


def allowed_globals() -> list[Any]:
    """The classes and functions beyond PyTorch's defaults that a skyspot checkpoint may name."""
    import numpy
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    dtypes = [type(numpy.dtype(name)) for name in ("uint32", "int64", "float64", "float32", "uint8", "bool")]
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, _reconstruct, numpy.ndarray, numpy.dtype, *dtypes]


def load(path: str | os.PathLike, map_location: Any = None, *, mmap: bool = False) -> Any:
    """`torch.load` that builds only tensors and the allowed globals; CheckpointError naming the file
    and what it tried to load otherwise."""
    import torch

    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        raise CheckpointError(f"refusing {path}: {_what(path, error)}") from None


def vet(path: str | os.PathLike) -> None:
    """Refuse `path` unless the weights-only loader accepts it (tensors mapped, not read). For files that
    DeepSpeed itself then loads with a full unpickler (the universal conversion, reshard.py)."""
    import zipfile

    load(path, map_location="cpu", mmap=zipfile.is_zipfile(path))  # mmap needs torch's zip format


def _what(path: str | os.PathLike, error: Exception) -> str:
    import torch

    try:
        with torch.serialization.safe_globals(allowed_globals()):
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:
        unsafe = []
    if unsafe:
        return (
            f"it names {', '.join(sorted(unsafe)[:3])}, which no skyspot checkpoint holds: skyspot did not "
            "write this file (who else can write to the run's store?)"
        )
    # No global named: the weights-only unpickler refused an opcode or a call; its own line says which.
    lines = str(error).strip().splitlines()
    detail = next((line.strip() for line in lines if "nsupported" in line), "")
    return (
        "it is not a file the weights-only loader reads"
        + (f" ({detail[:160]})" if detail else "")
        + ": damaged, or not written by skyspot"
    )
