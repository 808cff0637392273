"""`skyspot recipes` (alias `ls`) and `skyspot render`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from skyspot.cli.common import display, handle_errors, out, err
from skyspot.errors import UsageError


@handle_errors
def recipes_command(
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list instead of a table."),
) -> None:
    """List the recipes: model, nodes x accelerator candidates, clouds."""
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
    display(rows, [("name", "RECIPE"), ("model", "MODEL"), ("nodes", "NODES"), ("per_node", "PER NODE"),
                   ("clouds", "CLOUDS")], as_json=as_json)


@handle_errors
def render_command(
    recipe: str = typer.Argument(..., help="Recipe name (see `skyspot recipes`) or path to a recipe YAML."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Overrides as section.key=value, e.g. train.steps=40."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the YAML to this file instead of stdout."),
) -> None:
    """Print the SkyPilot managed-job task YAML a recipe renders to."""
    from skyspot.launch import build

    built = build(recipe, overrides or [])
    text = built.yaml
    if output is None:
        out.file.write(text)
        return
    if output.exists() and output.is_dir():
        raise UsageError(f"-o {output} is a directory; name a file")
    tmp = output.with_name(output.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(output)
    except OSError as error:
        raise UsageError(f"cannot write {output}: {error.strerror}") from None
    err.print(f"wrote {output}")
