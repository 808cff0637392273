"""The options and arguments several commands share, declared once with one help text each.

A command takes them as `as_json: JsonOption = False`, `recipe: RecipeArgument`, ... (Typer's Annotated
aliases), so `--json`, `-y/--yes`, `-d/--detach`, a recipe and a run name read the same everywhere.
"""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON (stable field names) instead of a table.")]
YesOption = Annotated[bool, typer.Option("-y", "--yes", help="Do not ask for confirmation.")]
DetachOption = Annotated[
    bool, typer.Option("-d", "--detach", help="Return once the run is submitted or started instead of following it.")
]
RecipeArgument = Annotated[str, typer.Argument(help="Recipe name (see `skyspot recipes`) or path to a recipe YAML.")]
OverridesArgument = Annotated[
    Optional[List[str]], typer.Argument(help="Overrides as section.key=value, e.g. train.steps=40.")
]
_RUN_HELP = "Run name (see `skyspot status -a`)."
RunArgument = Annotated[str, typer.Argument(metavar="RUN", help=_RUN_HELP)]
OptionalRunArgument = Annotated[Optional[str], typer.Argument(metavar="[RUN]", help=_RUN_HELP)]
"""A run name a command can do without: each command's description says what it does then."""
