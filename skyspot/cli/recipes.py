"""`skyspot recipes` (alias `ls`), `skyspot keys`, `skyspot cp` and `skyspot render`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from skyspot.cli.common import Column, display, handle_errors
from skyspot.cli.options import JsonOption, OverridesArgument, RecipeArgument
from skyspot.cli.output import ForceOption, check_output, write_output
from skyspot.console import err
from skyspot.errors import UsageError


@handle_errors
def recipes_command(
    as_json: JsonOption = False,
    verbose: bool = typer.Option(False, "-v", "--verbose",
                                 help="Also check, per cloud, whether an emergency checkpoint becomes durable "
                                      "within the preemption notice window (docs/planning.md)."),
) -> None:
    """List the recipes: model, nodes x accelerator candidates, clouds."""
    import json

    from skyspot.cli import cache

    entry = cache.key("recipes", ["-v" if verbose else ""])
    cached = cache.get(entry)
    rows = json.loads(cached) if cached else _recipe_rows(verbose)
    if not cached:
        cache.put(entry, json.dumps(rows))
    columns = [Column("name", "RECIPE"), Column("model", "MODEL", 2), Column("nodes", "NODES", 3, right=True),
               Column("per_node", "PER NODE", wrap=True), Column("clouds", "CLOUDS", 1)]
    if verbose:
        columns += [Column("state_per_node", "STATE/NODE", right=True),
                    Column("window", "EMERGENCY CKPT VS NOTICE WINDOW", wrap=True)]
    display(rows, columns, as_json=as_json)


def _recipe_rows(verbose: bool) -> list[dict]:
    from skyspot.recipe import list_recipes

    rows = []
    for recipe in list_recipes():
        res = recipe.resources
        per_node = " | ".join(res.accelerators) if res.accelerators else f"CPU x{res.ranks_per_node} ranks"
        rows.append({
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
        })
        if verbose:
            rows[-1].update(_window_fields(recipe))
    return rows


def _window_fields(recipe) -> dict:
    from skyspot.planning.notice_window import check_notice_windows

    report = check_notice_windows(recipe)
    if not report.state.known:
        return {"state_per_node": None, "window": "unknown model size", "window_checks": []}
    return {
        "state_per_node": f"{report.state.bytes_per_node / 1e9:,.1f} GB",
        "window": "; ".join(f"{c.cloud} {c.window_s:.0f}s: {c.verdict} (durable after {c.durable_at_s:,.0f}s)"
                            for c in report.checks),
        "window_checks": [c.to_dict() for c in report.checks],
    }


@handle_errors
def keys_command(
    recipe: Optional[str] = typer.Argument(None, metavar="[RECIPE]",
                                           help="A recipe name or file: show its values. Without: the defaults."),
    as_json: JsonOption = False,
) -> None:
    """Every key a recipe takes, as an override spells it (train.steps=40), with its type, the default
    (or RECIPE's value) and what it does."""
    from skyspot.recipe import load_recipe
    from skyspot.recipe_keys import recipe_keys, value_at

    loaded = load_recipe(recipe, environ={}) if recipe else None
    rows = []
    for key in recipe_keys():
        row = {"key": key.name, "type": key.type, "required": key.required,
               "default": None if key.required else key.default, "description": key.description}
        if loaded is not None:
            row["value"] = value_at(loaded, key.name)
        rows.append(row)
    if as_json:
        display(rows, [], as_json=True)
        return
    # Like --help, not a table: a key's description is a sentence or two, which no table column fits.
    import textwrap

    from skyspot.cli.common import terminal_width

    width = max(40, terminal_width())
    lines = []
    for row in rows:
        if loaded is not None:
            shown = f"= {_plain(row['value'])}"
        else:
            shown = "(required)" if row["required"] else f"default {_plain(row['default'])}"
        lines.append(f"{row['key']}  {row['type']}  {shown}")
        lines += textwrap.wrap(row["description"], width=width, initial_indent="    ", subsequent_indent="    ")
    sys.stdout.write("\n".join(lines) + "\n")


def _plain(value) -> str:
    if value is None:
        return "unset"
    if value == "":
        return '""'
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        import json

        return json.dumps(value)
    return str(value)


@handle_errors
def copy_command(
    recipe: RecipeArgument,
    destination: str = typer.Argument(..., metavar="DEST", help="A new file, or a directory to copy it into."),
) -> None:
    """Copy a recipe to a file of your own to edit (like torchtune's `tune cp`), then launch that file.

    Only recipes: a registry name, or a file that loads as a recipe (so `cp` is no way to copy any
    file the user can read); the copy is never more open than its source."""
    from skyspot.errors import RecipeError
    from skyspot.recipe import load_recipe, recipe_path

    if not destination.strip():
        raise UsageError("DEST is empty: name a new file or a directory, e.g. `skyspot cp tiny my-tiny.yaml`")
    source = recipe_path(recipe)
    try:
        load_recipe(recipe, environ={})  # the file as it is, without this shell's SKYSPOT_* settings
    except RecipeError as error:
        raise UsageError(f"{recipe} is not a recipe skyspot can load ({'; '.join(error.problems[:2])}); "
                         "`skyspot cp` copies recipes only") from None
    try:
        data, mode = source.read_bytes(), source.stat().st_mode & 0o777
    except OSError as error:
        raise UsageError(f"cannot read {source}: {error.strerror or error}") from None
    target = Path(destination)
    target = target / source.name if target.is_dir() else target
    target = write_output(target, data, force=False, flag="DEST", cap=mode, forceable=False)
    launchable = str(target) if (os.sep in str(target) or str(target).endswith((".yaml", ".yml"))) else f"./{target}"
    err.print(f"copied {recipe} to {target}; edit it, then: skyspot launch {launchable}", markup=False)


@handle_errors
def render_command(
    recipe: RecipeArgument,
    overrides: OverridesArgument = None,
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the YAML to this file instead of stdout."),
    force: ForceOption = False,
) -> None:
    """Print the SkyPilot managed-job task YAML a recipe renders to (launchable with `sky jobs launch`)."""
    from skyspot.cli import cache

    if output is not None:
        check_output(output, force=force, flag="-o")  # before the work: a taken name costs nothing
    # Repeating a render skips loading the recipe models and hashing the package (skyspot/cli/cache.py).
    entry = cache.key("render", [recipe, "\0", *(overrides or [])], files=[recipe])
    text = cache.get(entry)
    if text is None:
        from skyspot.task import package as packaging
        from skyspot.app.launch import build, check_store

        # The real wheel folder, not the golden files' placeholder: the output is a task SkyPilot can launch.
        package = packaging.build()
        built = build(recipe, overrides or [], package=package)
        check_store(built.recipe, local=False)  # a cloud task with a store on this machine: refused as launch does
        text = built.yaml
        cache.put(entry, text, needs=[package.wheel])
    if output is None:
        sys.stdout.write(text)  # not through rich: importing it would cost this command a fifth of its time
        return
    written = write_output(output, text.encode("utf-8"), force=force, flag="-o")
    err.print(f"wrote {written}", markup=False)

