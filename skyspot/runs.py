"""Runs: naming, recording launches in the ledger, and the summary `status` shows for each run."""

from __future__ import annotations

import re
import secrets
import time
from typing import Any, Optional

from skyspot.errors import UsageError

# A run name becomes a directory and a SkyPilot job name: no separators, no dots, nothing to escape with.
RUN_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


def check_run_name(name: str) -> str:
    if not RUN_NAME.match(name or ""):
        raise UsageError(f"run name '{name}' is not allowed: use 1-63 lowercase letters, digits and hyphens, "
                         "starting with a letter or digit")
    return name


def new_run_name(recipe: str) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return f"{recipe}-{stamp}-{secrets.token_hex(2)}"


def record_sky_launch(name: str, built, job_id: Optional[int]) -> None:
    from skyspot.ledger import Ledger

    ledger = Ledger()
    try:
        ledger.add(name, built.recipe.name, "sky", status="PENDING", store=built.recipe.storage.store,
                   job_id=job_id, total_steps=built.recipe.train.steps, num_nodes=built.recipe.resources.num_nodes,
                   info=_info(built))
    finally:
        ledger.close()


def _info(built) -> dict[str, Any]:
    return {"candidates": [{"cloud": c.cloud, "region": c.region, "accelerators": c.accelerators,
                            "instance_type": c.instance_type, "spot": c.spot} for c in built.candidates],
            "recipe_fingerprint": built.recipe.fingerprint()}
