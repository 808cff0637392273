"""How long a start may take before its first step, from one I/O plan: the bytes a start must fetch for
the recipe's model and data, at the slowest store bandwidth we plan for.

    bounds = start_bounds(recipe)   # StartBounds(download_seconds, io_seconds, first_step_seconds)

Two clocks watch a start and both come from here, so they cannot disagree:

- `io_seconds`: how long ranks wait in the I/O group while one rank fetches (trainer/comm.py): at least
  IO_TIMEOUT_S (2 h), longer when the plan needs it;
- `first_step_seconds`: the watchdog's bound from a (re)start to its first step (trainer/watchdog.py, passed
  by the rendered run as `--first-step-bound`): the recipe's `resilience.first_step_seconds`, raised to the
  I/O group's wait plus LOAD_MARGIN_S when the recipe's model is big enough to need it. Before this, the
  I/O group allowed llama70b 2 h for its first download (141 GB at 20 MB/s) and the watchdog killed it after
  1 h without a step, restarting in place what was only slow, and spending the restart budget.

A model built from an inline config, or read from a local directory, is not downloaded; a hub dataset's
size is not known before it is fetched and counts as nothing (a local data file counts its size).
Import-light (no torch): the renderer and the trainer both import it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional

from skyspot.errors import UsageError
from skyspot.sizing import model_params

if TYPE_CHECKING:
    from skyspot.recipe import Recipe

PLANNED_BANDWIDTH_BPS = 20e6  # ours: the slowest sustained store read planned for (a cold bucket over one stream)
IO_TIMEOUT_S = 7200.0  # the I/O group's least wait: 141 GB at 20 MB/s, llama70b's base, rounded up to 2 h
LOAD_MARGIN_S = 900.0  # ours: after the download, loading 141 GB into ZeRO-3, the resume and a first step
WEIGHT_BYTES_PER_PARAM = 2  # the hub's Llama weights are bf16 safetensors (70.55e9 params: 141.1 GB)


@dataclass(frozen=True)
class StartBounds:
    download_bytes: int
    """What a first start fetches: the base model's weights and a local data file."""
    download_seconds: float
    """That at PLANNED_BANDWIDTH_BPS."""
    io_seconds: float
    """The I/O group's timeout (trainer/comm.py)."""
    first_step_seconds: float
    """The watchdog's bound from a (re)start to its first step (trainer/watchdog.py)."""


def download_bytes(recipe: "Recipe", environ: Optional[Mapping[str, str]] = None) -> int:
    """Bytes a first start of `recipe` fetches (the base model's weights, a local data file's size)."""
    total = 0
    model = recipe.model
    if model.hub_id and not model.is_local:
        try:
            params, _ = model_params(recipe, environ)
        except UsageError:  # a nonsense SKYSPOT_MODEL_PARAMS is the sizing's error to report (at launch), not ours
            params = None
        total += WEIGHT_BYTES_PER_PARAM * (params or 0)
    source = recipe.data.source
    if source != "synthetic" and "://" not in source and os.path.isfile(source):
        total += os.path.getsize(source)
    return total


def start_bounds(recipe: "Recipe", environ: Optional[Mapping[str, str]] = None) -> StartBounds:
    """The I/O group's timeout and the first-step bound for `recipe`, from one plan. Pure but for a data file's size."""
    size = download_bytes(recipe, environ)
    download = size / PLANNED_BANDWIDTH_BPS
    io = max(IO_TIMEOUT_S, download)
    first_step = recipe.resilience.first_step_seconds
    if download + LOAD_MARGIN_S > first_step:  # the download alone could outlast the recipe's bound
        first_step = io + LOAD_MARGIN_S
    return StartBounds(size, round(download, 1), io, first_step)
