"""`skyspot launch` and `skyspot resume`: plan, render and submit a run (SkyPilot managed job, or the local executor)."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from skyspot.cli.common import confirm, handle_errors, split_csv
from skyspot.cli.options import DetachOption, OverridesArgument, RecipeArgument, RunArgument, YesOption
from skyspot.console import err, out

REHEARSE_HELP = (
    "Before the launch, rehearse each distinct (cloud, image, accelerator) among the spot candidates: "
    "a short spot job on 1 node (2 for a multi-node recipe) with the run's setup, image and store, the "
    "fabric probe, a store round trip and 5 steps of the tiny model; a table says what works, minutes "
    "and cost; the launch skips candidates that failed (kept in $SKYSPOT_HOME; --force keeps them). "
    "With --local, each on a fresh node simulating its cloud. With --dry-run: what would be rehearsed."
)
LOCAL_HELP = (
    "Run on this machine with the embedded local executor, which injects preemptions and "
    "recovers like SkyPilot's controller. Recipes marked local-only (tiny) run locally by default."
)


@handle_errors
def launch_command(
    recipe: RecipeArgument,
    overrides: OverridesArgument = None,
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the task YAML and the candidate table; submit nothing."
    ),
    yes: YesOption = False,
    detach: DetachOption = False,
    name: Optional[str] = typer.Option(None, "-n", "--name", help="Run name (default: recipe name + timestamp)."),
    clouds: Optional[str] = typer.Option(None, "--clouds", help="Comma-separated clouds to consider: aws,gcp,azure."),
    store: Optional[str] = typer.Option(
        None, "--store", help="Where checkpoints and events live: s3://bucket/prefix, gs://…, az://… or a local path."
    ),
    no_on_demand_fallback: bool = typer.Option(False, "--no-on-demand-fallback", help="Spot candidates only."),
    deadline: Optional[str] = typer.Option(
        None,
        "--deadline",
        help="Finish by then at the least cost: 36h, 90m, 2d or an ISO time (resources.deadline; docs/deadline.md). Spot while there is slack, on-demand when behind.",
    ),
    local: Optional[bool] = typer.Option(None, "--local/--cloud", help=LOCAL_HELP),
    preempt_every: Optional[float] = typer.Option(
        None, "--preempt-every", help="Local: inject a preemption every N seconds of running."
    ),
    preempt_at_steps: Optional[str] = typer.Option(
        None,
        "--preempt-at-steps",
        help="Local: inject a preemption notice when the run reaches these steps, e.g. 15,40.",
    ),
    crash_at_steps: Optional[str] = typer.Option(
        None,
        "--crash-at-steps",
        help="Local: SIGKILL one rank mid-step once the run reaches these steps, STEP[:NODE[.LOCAL_RANK]] (default the last rank of the last node), e.g. 15,40:0.1; recovered in place (docs/local.md).",
    ),
    hang_at_steps: Optional[str] = typer.Option(
        None,
        "--hang-at-steps",
        help="Local: SIGSTOP one rank mid-step (a hang), STEP[:NODE[.LOCAL_RANK]] as --crash-at-steps.",
    ),
    cut_link_at_steps: Optional[str] = typer.Option(
        None,
        "--cut-link-at-steps",
        help="Local, with --netns: drop every packet of one node's link mid-step (no reset, as a VM that vanished), STEP[:NODE] (default the last node); new machines at the recovery.",
    ),
    netns: bool = typer.Option(
        False,
        "--netns",
        help="Local: run each node in a network namespace of its own, with its own address (root; docs/local.md).",
    ),
    spot_trace: Optional[str] = typer.Option(
        None, "--spot-trace", help="Local: replay a spot trace file (docs/local.md)."
    ),
    notice: Optional[float] = typer.Option(
        None,
        "--notice",
        min=0,
        help="Local: the simulated cloud's notice window in seconds, its timeline scaled to fit (default the cloud's: aws 120, gcp 30, azure 30; docs/local.md).",
    ),
    grace: Optional[float] = typer.Option(
        None,
        "--grace",
        min=0,
        help="Local: seconds from SIGTERM to SIGKILL on aws's timeline and on cancel (default: aws's shutdown, scaled; 30 on cancel).",
    ),
    provision_delay: float = typer.Option(
        2.0, "--provision-delay", min=0, help="Local: seconds to 'provision' a replacement node."
    ),
    fallback_after: Optional[int] = typer.Option(
        None, "--fallback-after", min=0, help="Local: after K preemptions run on-demand (no more preemptions)."
    ),
    spot_nodes: Optional[str] = typer.Option(
        None,
        "--spot-nodes",
        help="Local: nodes granted to each spot attempt in turn, e.g. 2,1,2 (fewer than num_nodes needs resources.min_nodes and a store).",
    ),
    simulate: Optional[str] = typer.Option(
        None,
        "--simulate",
        help="Local: the cloud the local node stands for (aws, gcp, azure): its notice mechanism and prices (default aws; after a rehearsal left candidates out, the first one kept).",
    ),
    fresh_node: bool = typer.Option(
        False,
        "--fresh-node",
        help="Local: run as SkyPilot does on a new VM: a new virtual environment without skyspot, the task's file mounts copied, its setup run, then its run.",
    ),
    rehearse: bool = typer.Option(False, "--rehearse", help=REHEARSE_HELP),
    force: bool = typer.Option(
        False,
        "--force",
        help="Keep the candidates whose last rehearsal failed (the launch leaves them out otherwise; the dry run lists them).",
    ),
) -> None:
    """Turn a recipe into a SkyPilot managed-job task and submit it (or run it locally with --local).

    With --rehearse, first one short job per distinct (cloud, image, accelerator) among the spot candidates
    proves setup, the fabric, the store and a few steps of a tiny model; the launch then skips what failed."""
    from dataclasses import replace

    from skyspot.app.launch import LaunchRequest, prepare, submit

    request = LaunchRequest(
        recipe=recipe,
        overrides=overrides or [],
        name=name,
        local=local,
        dry_run=dry_run,
        confirmed=yes,
        interactive=sys.stdin.isatty(),
        flags={
            "resources.clouds": split_csv(clouds),
            "storage.store": store,
            "resources.on_demand_fallback": False if no_on_demand_fallback else None,
            "resources.deadline": deadline,
        },
        executor_flags={
            "preempt_every": preempt_every,
            "preempt_at_steps": preempt_at_steps,
            "crash_at_steps": crash_at_steps,
            "hang_at_steps": hang_at_steps,
            "cut_link_at_steps": cut_link_at_steps,
            "netns": netns or None,
            "spot_trace": spot_trace,
            "notice": notice,
            "grace": grace,
            "provision_delay": provision_delay,
            "fallback_after": fallback_after,
            "spot_nodes": spot_nodes,
            "simulate": simulate,
            "fresh_node": fresh_node or None,
        },
        force=force,
    )
    if rehearse:
        from skyspot.app.rehearse import plan_rehearsals, run_rehearsals

        plan = plan_rehearsals(request)
        _show_rehearsal_plan(plan)
        if not dry_run:
            if plan.question and not confirm(plan.question, yes):
                err.print("not rehearsed, not launched")
                raise typer.Exit(1)
            _show_rehearsals(run_rehearsals(plan))
            request = replace(request, confirmed=request.confirmed or plan.question is not None)
    prepared = prepare(request)
    if prepared.deadline:
        err.print(prepared.deadline["check"], markup=False, soft_wrap=True)
    if dry_run:
        _show_plan(prepared)
        _show_window_check(prepared, warn_only=False)
        _show_package(prepared.built)
        out.file.write(prepared.built.yaml)
        return
    if prepared.question:  # it costs money: the plan first, then the question
        _show_plan(prepared)
        _show_window_check(prepared, warn_only=True)
        if not confirm(prepared.question, yes):
            err.print("not launched")
            raise typer.Exit(1)
    raise typer.Exit(submit(prepared, detach=detach))


@handle_errors
def resume_command(
    run_name: RunArgument,
    yes: YesOption = False,
    detach: DetachOption = False,
) -> None:
    """Continue a cancelled, failed or interrupted run under its own name, from its newest durable checkpoint."""
    from skyspot.app.runs import prepare_resume, resume

    prepared = prepare_resume(run_name)
    if prepared.ignored:  # the run's settings are the ones recorded at launch (issue 31, item 6)
        err.print(
            f"note: ignoring {', '.join(prepared.ignored)} from this shell: a resumed run keeps the settings "
            "it was launched with; launch a new run to change them",
            markup=False,
            highlight=False,
        )
    if prepared.question and not confirm(prepared.question, yes):
        err.print("not resumed")
        raise typer.Exit(1)
    raise typer.Exit(resume(prepared, detach=detach))


def _show_package(built) -> None:
    """What every node installs: the wheel `launch` mounts, and the stack it pins."""
    package = built.package
    if package is None:
        err.print("package: none mounted (this local run uses the skyspot installed here)")
        return
    from skyspot.app.launch import PACKAGE_MOUNT

    err.print(
        f"package: skyspot {package.version} ({package.wheel}) mounted at {PACKAGE_MOUNT}; "
        f"setup installs it with {', '.join(package.requirements)}",
        markup=False,
        soft_wrap=True,
    )
    if built.run_name is None:
        err.print("run name: chosen at launch (RECIPE-YYYYmmdd-HHMMSS-xxxx), or -n NAME", markup=False)


def _show_plan(prepared) -> None:
    from rich.table import Table

    built = prepared.built
    nodes = built.recipe.resources.num_nodes
    money = lambda v: "-" if v is None else f"{v:,.2f}"  # noqa: E731
    title = (
        f"{built.recipe.name}: {nodes} node(s); candidates in the order SkyPilot tries them, spot first, "
        f"each group by {'expected $/h of training' if built.recipe.resources.placement == 'expected_cost' else 'price'}"
        f" for all nodes (price snapshot; egress to and from the store; preemptions: below)"
    )
    table = Table(title=title, header_style="bold")
    for header in (
        "#",
        "CLOUD",
        "REGION",
        "ACCELERATORS",
        "INSTANCE",
        "CAPACITY",
        "NODES $/H",
        "EGRESS $/H",
        "TOTAL $/H",
        "PREEMPT/NODE-H",
        "EXPECTED $/H",
        "NOTE",
    ):
        table.add_column(header)
    for i, c in enumerate(built.candidates, 1):
        compute = None if c.usd_per_hour is None else c.usd_per_hour * nodes
        note = "; ".join(n for n in (c.price_note, c.egress_note, c.fabric) if n)
        table.add_row(
            str(i),
            c.cloud,
            c.region or "any",
            c.accelerators or "CPU",
            c.instance_type or "-",
            "spot" if c.spot else "on-demand",
            money(compute),
            money(c.egress_usd_per_hour),
            money(c.expected_usd_per_hour),
            "-" if c.preemptions_per_node_hour is None else f"{c.preemptions_per_node_hour:.3f}",
            money(c.expected_cost_usd_per_hour),
            note,
        )
    err.print(table)
    for line in prepared.placement_notes():
        err.print(line, markup=False, highlight=False, soft_wrap=True)
    for candidate, record in prepared.rehearsed:
        fate = "kept (--force)" if prepared.request.force else "skipped (--force to keep)"
        err.print(
            f"{_where(candidate)}: rehearsal failed {record.when()}: {record.line}; {fate}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    for cloud, accelerators, why in prepared.dropped():
        err.print(f"not a candidate: {cloud} {accelerators}: {why}", markup=False)
    basis = prepared.egress_basis()
    if basis:
        err.print(basis, markup=False)
    for line in prepared.efa_notes():
        err.print(line, markup=False, soft_wrap=True)


def _show_window_check(prepared, *, warn_only: bool) -> None:
    """Can an emergency checkpoint become durable within each cloud's notice window? (docs/planning.md)"""
    from rich.table import Table

    recipe = prepared.recipe
    report = prepared.window_report()
    if not report.state.known:
        err.print(f"notice-window check skipped: {report.state.note}")
        return
    failing = [c for c in report.checks if c.verdict != "durable in time"]
    if warn_only:
        if failing:
            err.print(
                f"warning: an emergency checkpoint cannot become durable within the notice window on "
                f"{', '.join(c.cloud for c in failing)}; a preemption there falls back to the last durable "
                f"interval checkpoint. `skyspot launch {recipe.name} --dry-run` shows the figures and fixes."
            )
        return
    gb = report.state.bytes_per_node / 1e9
    table = Table(
        title=f"Emergency checkpoint vs notice window ({gb:,.1f} GB of ZeRO-3 state per node)", header_style="bold"
    )
    for header in ("CLOUD", "WINDOW", "LOCAL COMMIT", "DURABLE IN BUCKET", "VERDICT"):
        table.add_column(header)
    for check in report.checks:
        table.add_row(
            check.cloud,
            f"{check.window_s:.0f}s",
            f"{check.local_at_s:,.0f}s",
            f"{check.durable_at_s:,.0f}s",
            check.verdict,
        )
    err.print(table)
    for check in report.checks:  # the arithmetic behind each verdict (docs/planning.md)
        err.print(f"{check.cloud}: {check.arithmetic}: {check.verdict}", markup=False)
    for line in report.advice:
        err.print(f"- {line}", markup=False)


def _where(candidate) -> str:
    capacity = "spot" if candidate.spot else "on-demand"
    return f"{candidate.cloud} {candidate.region or 'any'} {candidate.accelerators or 'CPU'} {capacity}"


def _show_rehearsal_plan(plan) -> None:
    nodes = plan.targets[0].nodes if plan.targets else 1
    err.print(
        f"rehearsal of '{plan.recipe.name}': {len(plan.targets)} spot candidate(s), {nodes} node(s) each, "
        "the tiny model for 5 steps: " + ", ".join(t.key.text() for t in plan.targets),
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


def _show_rehearsals(records) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(
        title="Rehearsals (recorded in $SKYSPOT_HOME/rehearsals.json; a failed one is skipped by the "
        "launch unless --force)",
        header_style="bold",
    )
    for header in ("CLOUD", "IMAGE", "ACCELERATORS", "RESULT", "MINUTES", "COST", "RUN"):
        table.add_column(header)
    for r in records:
        table.add_row(
            r.cloud,
            r.image,
            r.accelerators,
            escape(r.line if r.ok else f"failed: {r.line}"),
            f"{r.minutes:.1f}",
            _money(r.cost_usd),
            r.run,
        )
    err.print(table)


def _money(usd) -> str:
    """A rehearsal costs cents: four decimals below a dollar (as `status` shows a run's cost so far)."""
    if usd is None:
        return "-"
    return f"${usd:,.4f}" if usd < 1 else f"${usd:,.2f}"
