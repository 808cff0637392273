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
    verbose: bool = typer.Option(
        False,
        "-v",
        "--verbose",
        help="Also check, per cloud, whether an emergency checkpoint becomes durable "
        "within the preemption notice window (docs/planning.md).",
    ),
) -> None:
    """List the recipes: model, nodes x accelerator candidates, clouds."""
    import json

    from skyspot.app.recipes import recipe_rows
    from skyspot.cli import cache

    entry = cache.key("recipes", ["-v" if verbose else ""])
    cached = cache.get(entry)
    rows = json.loads(cached) if cached else recipe_rows(verbose)
    if not cached:
        cache.put(entry, json.dumps(rows))
    columns = [
        Column("name", "RECIPE"),
        Column("model", "MODEL", 2),
        Column("nodes", "NODES", 3, right=True),
        Column("per_node", "PER NODE", wrap=True),
        Column("clouds", "CLOUDS", 1),
    ]
    if verbose:
        columns += [
            Column("state_per_node", "STATE/NODE", right=True),
            Column("window", "EMERGENCY CKPT VS NOTICE WINDOW", wrap=True),
        ]
    display(rows, columns, as_json=as_json)


@handle_errors
def keys_command(
    recipe: Optional[str] = typer.Argument(
        None, metavar="[RECIPE]", help="A recipe name or file: show its values. Without: the defaults."
    ),
    as_json: JsonOption = False,
) -> None:
    """Every key a recipe takes, as an override spells it (train.steps=40), with its type, the default
    (or RECIPE's value) and what it does."""
    from skyspot.app.recipes import key_rows

    rows = key_rows(recipe)
    if as_json:
        display(rows, [], as_json=True)
        return
    # Like --help, not a table: a key's description is a sentence or two, which no table column fits.
    import textwrap

    from skyspot.cli.common import terminal_width

    width = max(40, terminal_width())
    lines = []
    for row in rows:
        if "value" in row:
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
    from skyspot.app.recipes import recipe_source

    if not destination.strip():
        raise UsageError("DEST is empty: name a new file or a directory, e.g. `skyspot cp tiny my-tiny.yaml`")
    source = recipe_source(recipe)
    target = Path(destination)
    target = target / source.path.name if target.is_dir() else target
    target = write_output(target, source.data, force=False, flag="DEST", cap=source.mode, forceable=False)
    launchable = str(target) if (os.sep in str(target) or str(target).endswith((".yaml", ".yml"))) else f"./{target}"
    err.print(f"copied {recipe} to {target}; edit it, then: skyspot launch {launchable}", markup=False)


@handle_errors
def render_command(
    recipe: RecipeArgument,
    overrides: OverridesArgument = None,
    output: Optional[Path] = typer.Option(
        None, "-o", "--output", help="Write the YAML to this file instead of stdout."
    ),
    force: ForceOption = False,
) -> None:
    """Print the SkyPilot managed-job task YAML a recipe renders to (launchable with `sky jobs launch`)."""
    from skyspot.cli import cache

    if output is not None:
        check_output(output, force=force, flag="-o")  # before the work: a taken name costs nothing
    # Repeating a render skips loading the recipe models and hashing the package (skyspot/cli/cache.py).
    entry = cache.key("render", [recipe, "\0", *(overrides or [])], files=[recipe], history=True)
    text = cache.get(entry)
    if text is None:
        from skyspot.app.recipes import render_task

        rendered = render_task(recipe, overrides or [])
        text = rendered.yaml
        cache.put(entry, text, needs=rendered.needs)
    if output is None:
        sys.stdout.write(text)  # not through rich: importing it would cost this command a fifth of its time
        return
    written = write_output(output, text.encode("utf-8"), force=force, flag="-o")
    err.print(f"wrote {written}", markup=False)
