"""The recipes' use-cases: `recipes` (the registry, with the notice-window check), `keys` (every key a recipe
takes), `cp` (a recipe to copy) and `render` (the task YAML a recipe renders to). The CLI parses, caches
(cli/cache.py) and prints what these return."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from skyspot.errors import RecipeError, UsageError

if TYPE_CHECKING:
    from skyspot.recipe import Recipe


def recipe_rows(verbose: bool = False) -> list[dict[str, Any]]:
    """One row per registry recipe: model, nodes, accelerators per node, clouds (`verbose`: the state per node
    and, per cloud, whether an emergency checkpoint becomes durable within the notice window)."""
    from skyspot.recipe import list_recipes

    rows = []
    for recipe in list_recipes():
        res = recipe.resources
        per_node = " | ".join(res.accelerators) if res.accelerators else f"CPU x{res.ranks_per_node} ranks"
        rows.append(
            {
                "name": recipe.name,
                "model": recipe.model.hub_id or "inline config",
                "nodes": res.num_nodes,
                "accelerators": res.accelerators,
                "per_node": per_node,
                "clouds": res.clouds,
                "spot": res.spot,
                "on_demand_fallback": res.on_demand_fallback,
                "local_only": res.local_only,
                "description": recipe.description,
            }
        )
        if verbose:
            rows[-1].update(_window_fields(recipe))
    return rows


def _window_fields(recipe: Recipe) -> dict[str, Any]:
    from skyspot.planning.notice_window import check_notice_windows

    report = check_notice_windows(recipe)
    if not report.state.known or report.state.bytes_per_node is None:  # the same: no size without a count
        return {"state_per_node": None, "window": "unknown model size", "window_checks": []}
    return {
        "state_per_node": f"{report.state.bytes_per_node / 1e9:,.1f} GB",
        "window": "; ".join(
            f"{c.cloud} {c.window_s:.0f}s: {c.verdict} (durable after {c.durable_at_s:,.0f}s)" for c in report.checks
        ),
        "window_checks": [c.to_dict() for c in report.checks],
    }


def key_rows(recipe: Optional[str] = None) -> list[dict[str, Any]]:
    """Every key a recipe takes, as an override spells it, with its type, default and description; with
    `recipe` (a name or a file, loaded without this shell's SKYSPOT_* settings), its value too."""
    from skyspot.recipe import load_recipe
    from skyspot.recipe_keys import recipe_keys, value_at

    loaded = load_recipe(recipe, environ={}) if recipe else None
    rows = []
    for key in recipe_keys():
        row = {
            "key": key.name,
            "type": key.type,
            "required": key.required,
            "default": None if key.required else key.default,
            "description": key.description,
        }
        if loaded is not None:
            row["value"] = value_at(loaded, key.name)
        rows.append(row)
    return rows


@dataclass
class RecipeSource:
    """A recipe file to copy: where it is, its bytes and its permission bits (a copy is never more open)."""

    path: Path
    data: bytes
    mode: int


def recipe_source(recipe: str) -> RecipeSource:
    """The file behind a registry name or a recipe file, once it loads as a recipe (so `cp` is no way to
    copy any file the user can read); UsageError otherwise."""
    from skyspot.recipe import load_recipe, recipe_path

    source = recipe_path(recipe)
    try:
        load_recipe(recipe, environ={})  # the file as it is, without this shell's SKYSPOT_* settings
    except RecipeError as error:
        raise UsageError(
            f"{recipe} is not a recipe skyspot can load ({'; '.join(error.problems[:2])}); "
            "`skyspot cp` copies recipes only"
        ) from None
    try:
        return RecipeSource(path=source, data=source.read_bytes(), mode=source.stat().st_mode & 0o777)
    except OSError as error:
        raise UsageError(f"cannot read {source}: {error.strerror or error}") from None


@dataclass
class Rendered:
    """`render`'s output: the task YAML, and the files it refers to (the wheel folder the nodes mount)."""

    yaml: str
    needs: list[str]


def render_task(recipe: str, overrides: Sequence[str] = ()) -> Rendered:
    """The SkyPilot managed-job task YAML a recipe renders to, launchable with `sky jobs launch`: with the real
    wheel folder (not the golden files' placeholder), and refused as a launch refuses it when its store is a
    directory on this machine."""
    from skyspot.app.launch import build, check_store
    from skyspot.task import package as packaging

    package = packaging.build()
    built = build(recipe, overrides, package=package)
    check_store(built.recipe, local=False)
    return Rendered(yaml=built.yaml, needs=[str(package.wheel)])
