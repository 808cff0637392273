"""What every command shares: error handling, one table helper for plain text or JSON, confirmation,
one-line usage errors and plain parameter coercion. The consoles themselves are skyspot/console.py."""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import PurePath
from typing import Optional, Any, Callable, Iterable, Sequence, Union

import typer

from skyspot.console import err, printable
from skyspot.errors import EXIT_USAGE, SkyspotError


def terminal_width(stream=None) -> int:
    """The columns a table may use on `stream` (stdout): COLUMNS, else the terminal's, else a wide page."""
    stream = stream or sys.stdout
    try:
        columns = int(os.environ.get("COLUMNS", ""))
        if columns > 0:
            return columns
    except ValueError:
        pass
    if stream.isatty():
        try:
            return os.get_terminal_size(stream.fileno()).columns
        except (OSError, ValueError, AttributeError):
            return 80
    return 160


def in_place_text(row: dict) -> str:
    """`2 (1 hang)`: a run's restarts on the same machines (#26), and how many of them a hang caused."""
    n, hangs = row.get("restarts_in_place") or 0, row.get("hangs") or 0
    if not (n or hangs):
        return "-"
    return f"{n}" + (f" ({hangs} hang{'s' if hangs != 1 else ''})" if hangs else "")


def loss_text(losses: dict) -> str:
    """`train loss 1.2000 (step 16), eval loss 1.1000 (step 16, perplexity 3.00)`, from app.status.latest_losses."""
    parts = []
    if losses.get("train_loss") is not None:
        parts.append(f"train loss {losses['train_loss']:.4f} (step {losses.get('train_loss_step')})")
    if losses.get("eval_loss") is not None:
        ppl = losses.get("eval_perplexity")
        parts.append(
            f"eval loss {losses['eval_loss']:.4f} (step {losses.get('eval_loss_step')}"
            + ("" if ppl is None else f", perplexity {ppl:,.2f}")
            + ")"
        )
    return ", ".join(parts)


FABRIC_MARK = "!"
"""After a fabric that warned (below its expected figure, or NCCL on sockets); the warning itself is a note."""


def fabric_text(fabric: Optional[dict], transport: Optional[str] = None) -> str:
    """The fabric as `status` and `cost-report` show it: `ofi 18.2 GB/s` (the probe's bus bandwidth), with the
    expected figure when the instance type has one (`ofi 18.2/50 GB/s`), and FABRIC_MARK when it warned."""
    if not fabric:
        return transport or "-"
    text = fabric.get("transport") or transport or "?"
    measured, expected = fabric.get("busbw_gbps"), fabric.get("expected_gbps")
    if isinstance(measured, (int, float)):
        text += f" {measured:.3g}" + (f"/{expected:g}" if isinstance(expected, (int, float)) else "") + " GB/s"
    return text + (f" {FABRIC_MARK}" if fabric.get("warning") else "")


def usd(value: Optional[float], places: Optional[int] = None) -> str:
    """Dollars with the sign in front (-$0.09, not $-0.09); four places below a dollar unless `places`."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if places is None:
        places = 4 if abs(value) < 1 else 2
    text = f"${abs(value):,.{places}f}"
    return f"-{text}" if value < 0 and text.strip("$0.,") else text


def fail(message: str, code: int = 1) -> "typer.Exit":
    err.print(f"[bold red]error:[/] {message}", markup=True, highlight=False, emoji=False)
    return typer.Exit(code)


def one_line(text: str) -> str:
    """`text` with line breaks and control characters escaped, so an error or a cell stays one line
    whatever the user typed (a name with a newline, a byte that is not UTF-8, an escape sequence)."""
    return printable(text)


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


@dataclass(frozen=True)
class Column:
    """One column of a table: the row key, its header, and when to hide it on a narrow terminal.

    `drop` 0 is always shown; otherwise, while the table is wider than the terminal, the column with
    the highest `drop` is hidden first (--json still has every field)."""

    key: str
    header: str
    drop: int = 0
    right: bool = False
    wrap: bool = False
    """Long text: when the table is still too wide, this column takes what is left and wraps."""


ColumnSpec = Union[Column, tuple]
GAP = "  "


def display(
    rows: Sequence[dict[str, Any]],
    columns: Sequence[ColumnSpec],
    *,
    as_json: bool,
    title: str | None = None,
    empty: str = "nothing to show",
    caption: str | None = None,
) -> None:
    """Render rows as a plain-text table that fits the terminal (columns: Column or (key, header[, drop]))
    or as a JSON list of the full row dicts."""
    if as_json:
        sys.stdout.write(json.dumps(_finite(list(rows)), indent=2, default=str, allow_nan=False) + "\n")
        return
    if not rows:
        err.print(empty)
        return
    width = terminal_width()
    text, hidden = table_text(rows, [_column(c) for c in columns], width=width)
    lines = _wrap(title, width) + [text] + _wrap(caption, width)
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
    if hidden:
        err.print(
            f"(hidden to fit {width} columns: {', '.join(hidden)}; a wider terminal or --json shows them)",
            markup=False,
            highlight=False,
            style="dim",
        )


def table_text(rows: Sequence[dict[str, Any]], columns: Sequence[Column], *, width: int) -> tuple[str, list[str]]:
    """The table as text no wider than `width` where hiding columns allows; returns it and the hidden headers."""
    cells = {c.key: [_cell(row.get(c.key)) for row in rows] for c in columns}
    widths = {c.key: max([_cell_len(c.header)] + [_cell_len(v) for v in cells[c.key]]) for c in columns}
    shown = list(columns)
    hidden: list[str] = []

    def total() -> int:
        return sum(widths[c.key] for c in shown) + len(GAP) * (len(shown) - 1)

    while total() > width:
        droppable = [c for c in shown if c.drop > 0]
        if not droppable:
            break
        victim = max(droppable, key=lambda c: (c.drop, -shown.index(c)))
        shown.remove(victim)
        hidden.append(victim.header)

    wrapped = [c for c in shown if c.wrap]
    if total() > width and wrapped:
        column = wrapped[-1]
        widths[column.key] = max(20, widths[column.key] - (total() - width))

    def line(values: Sequence[str]) -> str:
        import textwrap

        split = [
            textwrap.wrap(v, widths[c.key], break_on_hyphens=False) or [""]
            if c.wrap and _cell_len(v) > widths[c.key]
            else [v]
            for c, v in zip(shown, values)
        ]
        out_lines = []
        for k in range(max(len(parts) for parts in split)):
            parts = []
            for column, pieces in zip(shown, split):
                value = pieces[k] if k < len(pieces) else ""
                pad = " " * max(0, widths[column.key] - _cell_len(value))
                parts.append(pad + value if column.right else value + pad)
            out_lines.append(GAP.join(parts).rstrip())
        return "\n".join(out_lines)

    header = line([c.header for c in shown])
    if _bold_ok():
        header = f"\x1b[1m{header}\x1b[0m"
    body = [line([cells[c.key][i] for c in shown]) for i in range(len(rows))]
    return "\n".join([header, *body]), hidden


def _wrap(text: Optional[str], width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(one_line(text), width=max(40, width), break_on_hyphens=False) if text else []


def _column(spec: ColumnSpec) -> Column:
    if isinstance(spec, Column):
        return spec
    return Column(*spec)


def _cell_len(text: str) -> int:
    if text.isascii():
        return len(text)
    from rich.cells import cell_len

    return cell_len(text)


def _bold_ok() -> bool:
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


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
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, (list, tuple)):
        return one_line(", ".join(str(v) for v in value))
    return one_line(str(value))


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
    exit_code = EXIT_USAGE

    def show(self, file=None) -> None:
        err.print(
            f"[bold red]error:[/] {_escape(one_line(self.format_message()))} (see --help)",
            markup=True,
            highlight=False,
            emoji=False,
        )


# Metavars Typer would print as {recipe} [overrides]... and <str>: arguments and option values by name.
ARG_METAVARS = {"overrides": "KEY=VALUE"}
_TYPE_METAVARS = {"str": "TEXT", "int": "INTEGER", "float": "NUMBER", "Path": "PATH"}


class _OneLineUsage:
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for param in self.params:
            if getattr(param, "metavar", "absent") is not None or getattr(param, "is_flag", False):
                continue
            if param.param_type_name == "argument":
                param.metavar = ARG_METAVARS.get(param.name, param.name.upper())
            else:
                annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
                if annotation is not bool:
                    param.metavar = _TYPE_METAVARS.get(getattr(annotation, "__name__", ""), "VALUE")

    def collect_usage_pieces(self, ctx):
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name != "argument":
                continue
            name = param.metavar or param.name.upper()
            if not param.required and not name.startswith("["):
                name = f"[{name}]"
            pieces.append(name + ("..." if param.nargs != 1 else ""))
        return pieces

    def parse_args(self, ctx, args):
        _plain_coercion(self, ctx)
        try:
            rest = super().parse_args(ctx, args)
        except _click_exceptions.UsageError as error:
            raise _OneLineUsageError(error.format_message()) from None
        _no_option_taken_as_a_value(self, ctx)
        return rest

    def resolve_command(self, ctx, args):
        try:
            return super().resolve_command(ctx, args)
        except _click_exceptions.UsageError as error:
            raise _OneLineUsageError(error.format_message()) from None


def _no_option_taken_as_a_value(command, ctx) -> None:
    """`launch --store --dry-run tiny`: Click gives --store the value `--dry-run`, and the launch would go on
    without the dry run the user asked for. An option's value that is one of the command's own option
    names is a missing value, said in one line."""
    names = {
        opt for param in command.get_params(ctx) for opt in (*param.opts, *param.secondary_opts) if opt.startswith("-")
    }
    for param in command.get_params(ctx):
        value = ctx.params.get(param.name)
        value = str(value) if isinstance(value, (str, PurePath)) else None
        if param.param_type_name == "option" and value in names:
            raise _OneLineUsageError(f"option '{param.opts[-1]}' needs a value, got the option '{value}'")


class OneLineCommand(_OneLineUsage, TyperCommand):
    """A command whose usage errors are one `error:` line."""


class OneLineGroup(_OneLineUsage, TyperGroup):
    """The application group: unknown commands are one `error:` line too."""


# --------------------------------------------------------------------------- fast parameter coercion
# Typer 0.29 coerces every parameter through a pydantic TypeAdapter, built on first use: importing
# pydantic and building the adapters cost a command that only reads the ledger about a fifth of its
# start-up. Our parameters are plain str, int, float, bool, Path and list[str]; those are coerced here
# the way Click did, and anything else still goes through Typer's own coercion.
try:
    from typer._coercion import RuntimeParam as _RuntimeParam
except ImportError:  # pragma: no cover - another Typer: leave its coercion alone
    _RuntimeParam = None

_PLAIN_NAMES = {int: "integer", float: "number"}


def _plain_coercion(command, ctx) -> None:
    if _RuntimeParam is None:
        return
    for param in command.get_params(ctx):
        if getattr(param, "_runtime_param", "absent") is not None:
            continue  # not a Typer parameter, or already set up
        descriptor = getattr(param, "type_descriptor", None)
        plain = _plain_type(getattr(descriptor, "annotation", None))
        if (
            plain is not None
            and not getattr(descriptor, "is_choice", True)
            and not getattr(descriptor, "is_ranged", True)
        ):
            param._runtime_param = _PlainRuntimeParam(
                parameter_info=descriptor.parameter_info, annotation=descriptor.annotation, kind=plain
            )


def _plain_type(annotation: Any):
    from pathlib import Path
    from typing import List, get_args, get_origin

    if annotation in (str, int, float, bool, Path):
        return annotation
    if get_origin(annotation) in (list, List) and get_args(annotation) == (str,):
        return list
    return None


if _RuntimeParam is not None:

    @dataclass(frozen=True)
    class _PlainRuntimeParam(_RuntimeParam):
        kind: Any = None

        def _coerce_value(self, value: Any, param, ctx) -> Any:
            from pathlib import Path

            kind = self.kind
            if kind is list:
                return [str(v) for v in value]
            if kind is bool:
                if isinstance(value, bool):
                    return value
                word = str(value).strip().lower()
                if word in ("1", "true", "t", "yes", "y", "on"):
                    return True
                if word in ("0", "false", "f", "no", "n", "off"):
                    return False
                raise _click_exceptions.BadParameter(f"{value!r} is not a valid boolean.", ctx=ctx, param=param)
            if kind is Path:
                return value if isinstance(value, Path) else Path(value)
            if kind is str:
                return value if isinstance(value, str) else str(value)
            if isinstance(value, kind) and not isinstance(value, bool):
                return value
            try:
                number = kind(str(value).strip())
            except ValueError:
                raise _click_exceptions.BadParameter(
                    f"{value!r} is not a valid {_PLAIN_NAMES[kind]}.", ctx=ctx, param=param
                ) from None
            if kind is float and not math.isfinite(number):
                raise _click_exceptions.BadParameter(f"{value!r} is not a finite number.", ctx=ctx, param=param)
            return number
