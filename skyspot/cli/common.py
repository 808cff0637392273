"""What every command shares: the consoles, error handling, and one table helper for rich or JSON output."""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any, Callable, Iterable, Sequence

import typer
from rich.console import Console
from rich.table import Table

from skyspot.errors import SkyspotError

# Data to stdout, diagnostics to stderr; rich honours NO_COLOR and drops colour off a TTY.
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def fail(message: str, code: int = 1) -> "typer.Exit":
    err.print(f"[bold red]error:[/] {message}", markup=True, highlight=False)
    return typer.Exit(code)


def handle_errors(fn: Callable) -> Callable:
    """Turn the project's errors into one line on stderr and the error's exit code, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SkyspotError as error:
            raise fail(_escape(str(error)), error.exit_code) from None
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130) from None

    return wrapper


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def display(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]], *, as_json: bool,
            title: str | None = None, empty: str = "nothing to show") -> None:
    """Render rows as a rich table (columns: (key, header)) or as a JSON list of the full row dicts."""
    if as_json:
        sys.stdout.write(json.dumps(list(rows), indent=2, default=str) + "\n")
        return
    if not rows:
        err.print(empty)
        return
    table = Table(title=title, show_lines=False, header_style="bold")
    for _, header in columns:
        table.add_column(header, overflow="fold")
    for row in rows:
        table.add_row(*[_cell(row.get(key)) for key, _ in columns])
    out.print(table)


def _cell(value: Any) -> str:
    from rich.markup import escape

    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, (list, tuple)):
        return escape(", ".join(str(v) for v in value))
    return escape(str(value))


def is_tty() -> bool:
    return sys.stdout.isatty() and not os.environ.get("CI")


def split_csv(value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def confirm(question: str, assume_yes: bool) -> bool:
    if assume_yes:
        return True
    if not sys.stdin.isatty():
        raise SkyspotError(f"{question} needs confirmation: pass -y/--yes when not attached to a terminal")
    return typer.confirm(question, default=False, err=True)


def join(items: Iterable[Any]) -> str:
    return ", ".join(str(i) for i in items)
