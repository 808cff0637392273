"""Benchmark 8's trainer: an emergency checkpoint with a store, from SIGTERM to durable in the store.

    torchrun --nproc_per_node 2 -m bench._emergency_worker --run-dir DIR --store URI [key=value ...]

Sets the trainer up exactly as `python -m skyspot.trainer tiny storage.store=URI` does (loop.setup,
loop.build), then runs the real loop; rank 0 sends itself SIGTERM at the end of the first step,
just before the ranks vote (held there by the `step_end` fault point until the signal is out), so
the figure is the checkpoint's, not a step's: on these CPU ranks a step of this model takes 10 s,
on a GPU node a second or so, and the trainer's notice logic budgets for it. The ranks write and
commit the emergency checkpoint (streaming it to the store while writing, unless
SKYSPOT_STREAM_UPLOADS=0), and each node leader makes its part durable. The window the trainer
allows a signal without a notice (30 s off a cloud) is raised to 600 s, so the figure is the time
the checkpoint takes, not the window. Rank 0 prints one `BENCH_JSON {...}` line: the
`emergency_checkpoint` event and the `upload_end` of that step.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

BIG = 10**9


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench._emergency_worker")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--store", required=True)
    parser.add_argument("overrides", nargs="*")
    opts = parser.parse_args(sys.argv[1:] if argv is None else argv)

    from bench._launch import emit_result, events
    from skyspot.trainer import durable, loop
    from skyspot.trainer.exit_codes import ERROR, PREEMPTED, Preempted
    from skyspot.trainer.preemption import PreemptionWatch

    durable.DEFAULT_WINDOW_S = 600.0  # measure the checkpoint, not the window
    faults = opts.run_dir.parent / f"{opts.run_dir.name}-faults"
    os.environ.update(SKYSPOT_FAULT="step_end@1/0:hold=120", SKYSPOT_FAULT_DIR=str(faults))
    watch = PreemptionWatch()
    watch.install()
    args = loop.parse_args(
        [
            "tiny",
            "--run-dir",
            str(opts.run_dir),
            f"storage.store={opts.store}",
            "--run-name",
            "bench",
            f"train.steps={BIG}",
            f"checkpoint.every_steps={BIG}",
            "train.log_every=1000000",
            *opts.overrides,
        ]
    )
    args.run_dir.mkdir(parents=True, exist_ok=True)
    run = loop.setup(args, watch)
    code, reason = ERROR, "benchmark failed"
    try:
        loop.build(run)
        sent = {}
        if run.placement.is_global_zero:

            def signal_at_the_boundary():
                fired = faults / "step_end@1.rank0"
                while not fired.exists():
                    time.sleep(0.005)
                sent["ts"] = time.time()
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # the handler has run
                (faults / "step_end@1.rank0.release").write_text("go")

            threading.Thread(target=signal_at_the_boundary, daemon=True).start()
        try:
            loop.train(run)
            raise RuntimeError("the loop ended without an emergency checkpoint")
        except Preempted:
            pass
        code, reason = PREEMPTED, "benchmark done"
        if run.placement.is_global_zero:
            found = events(run.run_dir, "emergency_checkpoint")[-1]
            uploads = []
            for _ in range(200):  # upload_end is written just after the marker is up
                uploads = [e for e in events(run.run_dir, "upload_end", rank=0) if e.get("step") == found["step"]]
                if uploads or found.get("durable_before_deadline") is not True:
                    break
                time.sleep(0.05)
            emit_result(
                {"emergency": {**found, "signal_sent": sent.get("ts")}, "upload": uploads[-1] if uploads else None}
            )
    except Exception:
        traceback.print_exc()
    finally:
        loop.cleanup(run, args, code, reason, run.step)
        watch.uninstall()
    return 0 if code == PREEMPTED else 1


if __name__ == "__main__":
    sys.exit(main())
