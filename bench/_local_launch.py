"""`skyspot launch RECIPE --local`, with another trainer module in the task's run script.

    python -m bench._local_launch --trainer-module bench._baseline_trainer --spot-trace T --notice 30 \
        -n NAME tiny checkpoint.every_steps=50 ...

The same launch as the CLI's (skyspot.app.launch prepare and submit: its checks, its preflight, the local
executor, its controller and follow); only `-m skyspot.trainer` in the rendered run script becomes
`-m MODULE`. The nodes import MODULE through PYTHONPATH, which the controller passes on.
"""

from __future__ import annotations

import argparse
import sys

TRAINER = "-m skyspot.trainer "


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench._local_launch")
    parser.add_argument("--trainer-module", required=True)
    parser.add_argument("--spot-trace")
    parser.add_argument("--notice", type=float, default=30.0)
    parser.add_argument("--grace", type=float, default=30.0)
    parser.add_argument("--provision-delay", type=float, default=2.0)
    parser.add_argument("-n", "--name", required=True)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    from skyspot.app.launch import LaunchRequest, prepare, submit

    prepared = prepare(
        LaunchRequest(
            recipe=args.recipe,
            overrides=args.overrides,
            name=args.name,
            local=True,
            executor_flags={
                "spot_trace": args.spot_trace,
                "notice": args.notice,
                "grace": args.grace,
                "provision_delay": args.provision_delay,
            },
        )
    )
    script = prepared.built.task["run"]
    if script.count(TRAINER) != 1:
        print(f"baseline not available: the rendered run script no longer has one '{TRAINER.strip()}'", file=sys.stderr)
        return 2
    prepared.built.task["run"] = script.replace(TRAINER, f"-m {args.trainer_module} ")
    return submit(prepared, detach=False)


if __name__ == "__main__":
    sys.exit(main())
