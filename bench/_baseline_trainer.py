"""The baseline most training blueprints ship: interval checkpoints, no signal or notice handling.

    torchrun ... -m bench._baseline_trainer tiny --run-dir DIR checkpoint.every_steps=50 ...

skyspot's own trainer, unchanged, with its emergency path switched off from outside:
SIGTERM and SIGUSR1 keep their default action (the process dies where it stands, as a script
without handlers does) and no notice watcher is started. Everything else (interval checkpoints,
resume from the newest committed one) is skyspot's, so the comparison isolates the emergency
path. The trainer has no switch for this; if the names patched here move, this exits 2 with
"baseline not available" rather than run something else.
"""

from __future__ import annotations

import sys

UNAVAILABLE = 2


def main() -> int:
    from skyspot.trainer import loop
    from skyspot.trainer.preemption import PreemptionWatch

    if not (
        callable(getattr(PreemptionWatch, "install", None)) and callable(getattr(loop, "_start_notice_watcher", None))
    ):
        print(
            "baseline not available: skyspot.trainer no longer has PreemptionWatch.install / "
            "loop._start_notice_watcher to switch off",
            file=sys.stderr,
        )
        return UNAVAILABLE
    PreemptionWatch.install = lambda self: None
    loop._start_notice_watcher = lambda watch: None
    return loop.main()


if __name__ == "__main__":
    sys.exit(main())
