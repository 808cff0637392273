"""Launch: recipe + overrides + flags -> a rendered task, ready for an executor.

One function (`build`) so that `render`, `launch --dry-run`, `launch` and the local
executor all see the same recipe, the same candidates and the same YAML.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from skyspot.plan import Candidate, candidates
from skyspot.recipe import REGISTRY, Recipe, env_overrides, load_recipe, parse_overrides
from skyspot.task import RECIPE_MOUNT, render, to_yaml

# Sections that change what the trainer computes; overrides of these travel to the node.
TRAINER_SECTIONS = ("model", "data", "train", "deepspeed", "checkpoint")


@dataclass
class Built:
    recipe: Recipe
    recipe_arg: str
    task: dict[str, Any]
    yaml: str
    candidates: list[Candidate]
    trainer_overrides: list[str] = field(default_factory=list)


def _trainer_overrides(overrides: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    pairs = env_overrides(environ) + parse_overrides(overrides)
    chosen: dict[str, str] = {}
    for (key, _), raw in zip(pairs, _raw_values(overrides, environ)):
        if key.split(".")[0] in TRAINER_SECTIONS:
            chosen[key] = f"{key}={raw}"  # later (CLI) wins over earlier (environment)
    return list(chosen.values())


def _raw_values(overrides: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    env_raw = [raw for name, raw in sorted(environ.items()) if name.startswith("SKYSPOT_") and "__" in name]
    return env_raw + [o.partition("=")[2] for o in overrides]


def build(recipe_arg: str, overrides: Sequence[str] = (), *, flags: Optional[Mapping[str, Any]] = None,
          run_name: Optional[str] = None, environ: Optional[Mapping[str, str]] = None,
          local: bool = False) -> Built:
    """Load and render. A registry name travels to the node as is; a recipe file is mounted
    on cloud nodes (RECIPE_MOUNT) or, for the local executor (`local`), read where it is."""
    environ = os.environ if environ is None else environ
    recipe = load_recipe(recipe_arg, overrides, environ=environ, flags=flags)
    trainer_overrides = _trainer_overrides(overrides, environ)
    if recipe_arg in REGISTRY:
        node_arg, recipe_file = recipe_arg, None
    elif local:
        node_arg, recipe_file = str(Path(recipe_arg).resolve()), None
    else:
        node_arg, recipe_file = RECIPE_MOUNT, str(Path(recipe_arg).resolve())
    task = render(recipe, recipe_arg=node_arg, recipe_file=recipe_file, overrides=trainer_overrides,
                  run_name=run_name)
    return Built(recipe=recipe, recipe_arg=recipe_arg, task=task, yaml=to_yaml(task, recipe),
                 candidates=candidates(recipe), trainer_overrides=trainer_overrides)
