"""What every command shares: the consoles, error handling, and one table helper for rich or JSON output."""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from typing import Optional, Any, Callable, Iterable, Sequence

import typer
from rich.console import Console
from rich.table import Table

from skyspot.errors import SkyspotError

# Data to stdout, diagnostics to stderr; rich honours NO_COLOR and drops colour off a TTY.
def _width(stream) -> Optional[int]:
    """Off a terminal rich assumes 80 columns and folds every table; use COLUMNS, else a wide page."""
    if os.environ.get("COLUMNS") or stream.isatty():
        return None
    return 160


out = Console(highlight=False, soft_wrap=True, width=_width(sys.stdout))
err = Console(stderr=True, highlight=False, soft_wrap=True, width=_width(sys.stderr))


def fail(message: str, code: int = 1) -> "typer.Exit":
    err.print(f"[bold red]error:[/] {message}", markup=True, highlight=False, emoji=False)
    return typer.Exit(code)


def one_line(text: str) -> str:
    """`text` with line breaks and control characters escaped, so an error stays one line
    whatever the user typed (a name with a newline, a byte that is not UTF-8)."""
    return "".join(c if c.isprintable() or c == " " else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for c in text)


def handle_errors(fn: Callable) -> Callable:
    """Turn the project's errors into one line on stderr and the error's exit code, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SkyspotError as error:
            raise fail(_escape(one_line(str(error))), error.exit_code) from None
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
        sys.stdout.write(json.dumps(_finite(list(rows)), indent=2, default=str, allow_nan=False) + "\n")
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


def _finite(value: Any) -> Any:
    """NaN and infinities as null: they are not JSON, and a figure that is not finite is unknown."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


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


# --------------------------------------------------------------------------- usage errors on one line
# Click reports a bad option or a missing argument as "Usage: ... Try ... Error: ..." over four
# lines. These classes (Typer(cls=OneLineGroup), app.command(cls=OneLineCommand)) make it the
# same one line every other error is: `error: ...`, exit 2.
try:  # recent Typer vendors Click as typer._click; older releases use Click itself
    from typer._click import exceptions as _click_exceptions
except ImportError:  # pragma: no cover
    from click import exceptions as _click_exceptions
from typer.core import TyperCommand, TyperGroup  # noqa: E402


class _OneLineUsageError(_click_exceptions.ClickException):
    exit_code = 2

    def show(self, file=None) -> None:
        err.print(f"[bold red]error:[/] {_escape(one_line(self.format_message()))} (see --help)",
                  markup=True, highlight=False, emoji=False)


class _OneLineUsage:
    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except _click_exceptions.UsageError as error:
            raise _OneLineUsageError(error.format_message()) from None

    def resolve_command(self, ctx, args):
        try:
            return super().resolve_command(ctx, args)
        except _click_exceptions.UsageError as error:
            raise _OneLineUsageError(error.format_message()) from None


class OneLineCommand(_OneLineUsage, TyperCommand):
    """A command whose usage errors are one `error:` line."""


class OneLineGroup(_OneLineUsage, TyperGroup):
    """The application group: unknown commands are one `error:` line too."""

