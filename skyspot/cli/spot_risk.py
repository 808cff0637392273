"""`skyspot spot-risk`: each spot placement's expected preemptions per node-hour and where the figure comes from."""

from __future__ import annotations

from typing import Optional

import typer

from skyspot.cli.common import Column, display, handle_errors
from skyspot.cli.options import JsonOption


@handle_errors
def spot_risk_command(
    cloud: Optional[str] = typer.Option(None, "--cloud", help="Only this cloud: aws, gcp or azure."),
    instance: Optional[str] = typer.Option(None, "--instance", help="Only this instance type."),
    region: Optional[str] = typer.Option(None, "--region", help="Only this region (else every region, and 'any')."),
    as_json: JsonOption = False,
) -> None:
    """The preemption risk each spot placement is planned with: our prior, the published signal, this machine's history."""
    from skyspot.app.spot_risk import spot_risk_rows

    found = spot_risk_rows(cloud, instance, region)
    rows = [{**r, "where": r["region"] or "any", "rate": f"{r['per_node_hour']:.3f}"} for r in found.rows]
    if as_json:
        rows = found.rows
    display(
        rows,
        [
            Column("cloud", "CLOUD"),
            Column("where", "REGION"),
            Column("instance_type", "INSTANCE"),
            Column("published", "PUBLISHED"),
            Column("observed", "OBSERVED"),
            Column("rate", "PREEMPT/NODE-H", right=True),
            Column("source", "SOURCE", wrap=True),
        ],
        as_json=as_json,
        title=f"Spot preemptions per node-hour as plans rank them: prior (ours) x the published signal "
        f"({found.feed}), blended with this machine's preemptions; placements from "
        f"the price snapshot {found.price_date} (docs/planning.md, Published signals)",
    )
