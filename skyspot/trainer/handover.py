"""Make-before-break on a cloud: a new stage's nodes wait for the stage they replace to stop.

    python -m skyspot.trainer.handover RECIPE [key=value ...]     (the task's `run`, when SKYSPOT_HANDOVER is set)

A deadline's controller on SkyPilot (executors/sky/deadline.py) switches capacity make-before-break: it
launches the next stage while the current one trains, with `SKYSPOT_HANDOVER=<token>` in the stage's
environment. SkyPilot provisions the new nodes and runs the task's setup on them meanwhile; then `run`
starts, and this waits, before anything touches the run's store or starts torchrun, until the object
`<store>/<run>/handover/<token>` exists. The controller writes it once SkyPilot reports the stage being
replaced ended (its nodes wrote their emergency checkpoint on SkyPilot's cancel). So the two stages never
train at once and never both write the store, and the new one resumes from the old one's last checkpoint.

A stage recovered later by SkyPilot runs `run` again with the same token: the object is there, and it goes
on at once. Without SKYSPOT_HANDOVER (every launch, the local executor) the task's `run` does not call this.
Cancelled while it waits (the controller withdrew the switch), it exits on SIGTERM as any process does.
"""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Optional

HANDOVER_ENV = "SKYSPOT_HANDOVER"
HANDOVER_DIR = "handover"
POLL_SECONDS = 5.0
TOKEN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
"""A token is one object name: never `.`, `..` or a path."""
TIMEOUT_ENV = "SKYSPOT_HANDOVER_TIMEOUT_SECONDS"
TIMEOUT_SECONDS = 2 * 3600.0
"""How long the nodes wait before they give up (exit 1: SkyPilot fails the stage, and the controller, which
launched it, sees it end before it was ready): a controller that died before it recorded the stage never
writes the handover, and idle GPUs must not wait for it forever. Two hours outlast the replaced stage's
emergency checkpoint and teardown with room, and the controller's restart by SkyPilot."""


def handover_key(run: str, token: str) -> str:
    """The object a stage's nodes wait for (the controller writes it, this reads it)."""
    from skyspot.storage import join_key

    return join_key(run, HANDOVER_DIR, token)


def wait(
    store, run: str, token: str, *, poll: float = POLL_SECONDS, timeout: float = TIMEOUT_SECONDS, say=print
) -> bool:
    """True once `<run>/handover/<token>` exists in `store` (a store out of reach is asked again); False when
    `timeout` seconds passed first."""
    key = handover_key(run, token)
    said = False
    give_up = time.monotonic() + timeout
    while True:
        try:
            if store.get_bytes(key) is not None:
                if said:
                    say("[skyspot] the stage this one replaces has stopped: starting")
                return True
        except Exception as error:  # noqa: BLE001 - a store out of reach for a while: ask again
            say(f"[skyspot] the handover could not be read yet ({str(error).splitlines()[0] if str(error) else error})")
        if not said:
            say(
                "[skyspot] make-before-break: this stage's nodes are ready; waiting for the stage it replaces "
                f"to checkpoint and stop (handover {token})"
            )
            said = True
        if time.monotonic() >= give_up:
            return False
        time.sleep(poll)


def main(argv: Optional[list[str]] = None) -> int:
    from skyspot.errors import EXIT_USAGE, SkyspotError
    from skyspot.recipe import load_recipe
    from skyspot.storage import open_store
    from skyspot.storage.uri import check_key

    argv = sys.argv[1:] if argv is None else argv
    token = os.environ.get(HANDOVER_ENV, "")
    run = os.environ.get("SKYSPOT_RUN_NAME", "")
    if not argv or not TOKEN.match(token) or not run:
        print(
            f"[skyspot] usage: {HANDOVER_ENV}=TOKEN SKYSPOT_RUN_NAME=RUN python -m skyspot.trainer.handover RECIPE [k=v ...]"
        )
        return EXIT_USAGE
    try:
        check_key(handover_key(run, token))
    except ValueError as error:
        print(f"[skyspot] {HANDOVER_ENV} or SKYSPOT_RUN_NAME is no object name: {error}")
        return EXIT_USAGE
    try:
        recipe = load_recipe(argv[0], argv[1:])
        if not recipe.storage.store:
            print("[skyspot] a handover needs the run's store (storage.store)")
            return EXIT_USAGE
        timeout = float(os.environ.get(TIMEOUT_ENV) or TIMEOUT_SECONDS)
        if not wait(
            open_store(recipe.storage.store),
            run,
            token,
            poll=float(os.environ.get("SKYSPOT_HANDOVER_POLL_SECONDS") or POLL_SECONDS),
            timeout=timeout,
        ):
            print(f"[skyspot] no handover {token} within {timeout:.0f}s: giving up (the controller did not hand over)")
            return 1
    except SkyspotError as error:
        print(f"[skyspot] {error}")
        return error.exit_code
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
