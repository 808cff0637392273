"""The `skyspot` application: registers one command per module; each command calls plain package functions."""

from __future__ import annotations

import typer

from skyspot import __version__
from skyspot.cli.launch import launch_command, resume_command
from skyspot.cli.common import OneLineCommand, OneLineGroup
from skyspot.cli.cost import cost_report_command, prices_command
from skyspot.cli.recipes import copy_command, keys_command, recipes_command, render_command
from skyspot.cli.runs import cancel_command, logs_command, status_command
from skyspot.cli.spot_risk import spot_risk_command

app = typer.Typer(
    name="skyspot",
    cls=OneLineGroup,
    help="Fine-tune LLMs on spot GPUs across AWS, GCP and Azure through SkyPilot managed jobs, "
    "losing nothing to preemptions. Try: skyspot launch tiny --local --preempt-at-steps 60,130",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        print(f"skyspot {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """skyspot: spot-instance LLM fine-tuning that is boringly reliable."""
    import os

    home = os.environ.get("SKYSPOT_HOME")
    if home:  # resolved once, before anything uses it: the processes a command starts run elsewhere
        os.environ["SKYSPOT_HOME"] = os.path.abspath(os.path.expanduser(home))


app.command("recipes", cls=OneLineCommand)(recipes_command)
app.command("ls", hidden=True, cls=OneLineCommand)(recipes_command)
app.command("keys", cls=OneLineCommand)(keys_command)
app.command("cp", cls=OneLineCommand)(copy_command)
app.command("render", cls=OneLineCommand)(render_command)
app.command("launch", cls=OneLineCommand)(launch_command)
app.command("resume", cls=OneLineCommand)(resume_command)
app.command("status", cls=OneLineCommand)(status_command)
app.command("logs", cls=OneLineCommand)(logs_command)
app.command("cancel", cls=OneLineCommand)(cancel_command)
app.command("cost-report", cls=OneLineCommand)(cost_report_command)
app.command("prices", cls=OneLineCommand)(prices_command)
app.command("spot-risk", cls=OneLineCommand)(spot_risk_command)


def main() -> None:  # console entry point
    app()


if __name__ == "__main__":
    main()
