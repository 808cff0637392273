"""Run the trainer's launcher and exit with the code the trainer recorded for this start.

    python -m skyspot.trainer.supervise --run-dir DIR [--grace SECONDS]
        [--hang-factor X --hang-floor SECONDS --first-step-bound SECONDS | --no-watchdog]
        -- torchrun ... -m skyspot.trainer ...

Why: torchrun exits 1 whenever a worker fails, whatever code the worker used, so SkyPilot's
`recover_on_exit_codes: [75]` and the local executor would never see "preempted, recover me".
The trainer writes DIR/exit.json just before exiting (exit_codes.py); this process exits with
that code when the record carries the token it gave this start, else with the command's own
code (128 + N when the command died of signal N).

Signals: SIGTERM, SIGINT, SIGUSR1 and SIGHUP received here are forwarded once to the command's
process group (the command runs in its own group, so a signal to ours is not delivered twice).
For torchrun the command's environment gets, unless already set:
    PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1   torchrun forwards SIGUSR1 too
                                                                  (by default SIGUSR1 kills it)
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT=<grace>                        how long torchrun lets workers
                                                                  finish the emergency checkpoint
                                                                  before SIGKILL (default 30 s)
If this process is killed outright, the command is SIGKILLed with it (PR_SET_PDEATHSIG), and the
trainer's workers die with torchrun the same way, so nothing keeps writing into DIR.

Shutdown warnings: this process runs the node's notice watcher (notice.py), started before the
command, so before the trainer's setup and model load (Azure's first Scheduled Events request turns
them on and they flow minutes later), and in a process of its own, so its polls never compete with a
rank for the GIL. What it sees goes to DIR/notices.json (preemption.NoticeFile, replaced atomically),
which the command learns of through SKYSPOT_NOTICE_FILE; the trainer's node leader stats it at every
step boundary and the step-boundary vote carries it to every rank, as a notice from a watcher inside
the trainer would be. A preemption is an emergency (train through the window, emergency checkpoint,
exit 75), a warning an early checkpoint. On the way out, after the command has exited, the watcher
stops and approves on Azure the events acted on (StartRequests). Without a cloud in
SKYPILOT_CLUSTER_INFO nothing is watched.

Hangs: once the command runs, this process runs the hang watchdog (watchdog.py), a thread that follows
the ranks' events in DIR/events/ and, when no step comes within its bound, dumps every rank's stacks,
records a `hang` event and DIR/hang.json, and SIGKILLs the workers so torchrun's agent restarts them in
place. The run script passes the recipe's `resilience` values as the flags above.
Restarts in place: torchrun's agent restarts its workers after a failure (task/render.py); this process
stays, and watches its torchrun's workers (worker_watch.py): each one's end, however it ends, goes to
DIR/worker_exits.json, from which the restarted generation learns when the failure was (trainer/restart.py).
A worker whose ending is final (complete, preempted, a configuration error, the budget spent) exits 0
so torchrun does not restart it (nor, with restarts off, print a ChildFailedError traceback), and its
exit record carries the code this process exits with. A configuration refusal (2) is then passed on
without a word of ours: the node's log ends with the trainer's one line, and SkyPilot and the local
executor see 2, not torchrun's 1.

The CLI is stable: the rendered SkyPilot task and the local executor call it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Optional

from skyspot.clouds import NOTICE_WINDOWS_S
from skyspot.trainer.parent_death import set_parent_death_signal
from skyspot.trainer.exit_codes import TOKEN_ENV, USAGE, describe, read_exit_record
from skyspot.trainer.preemption import NOTICE_FILE_ENV, NOTICE_FILE_NAME, NoticeFile
from skyspot.trainer.watchdog import Bounds, start_watchdog
from skyspot.trainer.worker_watch import watch_workers

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
DEFAULT_GRACE_S = max(NOTICE_WINDOWS_S.values())  # the longest notice window (AWS's); GCP and Azure give 30 s
WAIT_SLICE_S = 0.5  # ours: the longest a forwarded signal can wait for the main thread (run's wait loop)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m skyspot.trainer.supervise", description="Run the trainer and exit with the code it recorded."
    )
    parser.add_argument("--run-dir", required=True, type=Path, help="the trainer's --run-dir")
    parser.add_argument(
        "--grace",
        type=_seconds,
        default=DEFAULT_GRACE_S,
        help="seconds torchrun gives workers after a signal before SIGKILL (default %(default)s)",
    )
    _watchdog_flags(parser)
    if "--" not in argv:
        parser.error(
            "give the command after --, e.g. -- torchrun --nproc_per_node 2 -m skyspot.trainer tiny --run-dir DIR"
        )
    split = argv.index("--")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        parser.error("no command after --")
    return args, command


def _watchdog_flags(parser: argparse.ArgumentParser) -> None:
    """The hang watchdog's bounds (watchdog.py), which the run script fills from the recipe's
    `resilience` section; the defaults are that section's."""
    from skyspot.recipe import ResilienceSection

    default = ResilienceSection()
    parser.add_argument(
        "--hang-factor",
        type=_resilience("hang_factor"),
        default=default.hang_factor,
        help="a hang: no step for longer than this x the median step time (default %(default)s)",
    )
    parser.add_argument(
        "--hang-floor",
        type=_resilience("hang_floor_seconds"),
        default=default.hang_floor_seconds,
        help="... or than this many seconds, whichever is longer (default %(default)s)",
    )
    parser.add_argument(
        "--first-step-bound",
        type=_resilience("first_step_seconds"),
        default=default.first_step_seconds,
        help="seconds allowed from a (re)start to its first step (default %(default)s)",
    )
    parser.add_argument("--no-watchdog", action="store_true", help="do not watch for hangs")


def _resilience(field: str):
    """An argparse type for the recipe's `resilience.<field>`: the value the recipe would accept and nothing
    else (issue 31, item 13: the supervisor took --hang-factor 1.5 and --hang-floor 1e300, which the recipe
    refuses), checked by the recipe's own field, so the two cannot drift apart."""
    from pydantic import ValidationError

    from skyspot.recipe import ResilienceSection

    def parse(text: str) -> float:
        value = float(text)
        try:
            ResilienceSection.model_validate({field: value})
        except ValidationError:
            raise ValueError(text) from None
        return value

    parse.__name__ = f"resilience.{field}"  # argparse adds " value": "invalid resilience.hang_factor value: '1.5'"
    return parse


def _seconds(text: str) -> float:
    """A grace in seconds: finite, from 0 to a day (torchrun's shutdown timeout is an int of it)."""
    value = float(text)
    if not 0 <= value <= 86400:
        raise ValueError(text)
    return value


_seconds.__name__ = "number of seconds (0 to 86400)"


def watchdog_bounds(args: argparse.Namespace) -> Optional[Bounds]:
    if args.no_watchdog:
        return None
    return Bounds(factor=args.hang_factor, floor_seconds=args.hang_floor, first_step_seconds=args.first_step_bound)


@contextlib.contextmanager
def _helpers_deaf():
    """Threads started inside block the forwarded signals, so the kernel hands them to the main thread.

    A signal sent to a process goes to any one of its threads that does not block it (signal(7)), and
    CPython runs a handler only in the main thread, at its next bytecode: one taken by the watchdog or
    a watcher thread while the main thread sleeps in waitpid would wait there until the command ended
    by itself, unforwarded. A thread inherits its creator's mask (pthread_sigmask(3)), so the mask is
    set around the threads' creation and restored after: what arrived meanwhile stays pending, and is
    delivered to the main thread once unblocked. A process such a thread starts keeps the mask across
    exec (the watchdog's py-spy: subprocess.run's timeout ends it with SIGKILL, which no mask stops).
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _child_setup(supervisor: int) -> None:
    """In the child, before exec: its own process group, and die with the supervisor (also when it
    died between the fork and the prctl, when no signal would come)."""
    os.setpgid(0, 0)
    if set_parent_death_signal(signal.SIGKILL) and os.getppid() != supervisor:
        os._exit(1)


def run(
    run_dir: Path,
    command: list[str],
    grace: float = DEFAULT_GRACE_S,
    say=lambda line: print(f"[skyspot.supervise] {line}", file=sys.stderr, flush=True),
    hang_bounds: Optional[Bounds] = None,
) -> int:
    token = uuid.uuid4().hex
    env = dict(os.environ)
    env[TOKEN_ENV] = token
    env.setdefault("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(int(grace)))
    notices = NoticeFile(run_dir / NOTICE_FILE_NAME, token)
    env[NOTICE_FILE_ENV] = str(notices.path)
    with _helpers_deaf():
        watcher = _watch(notices, say)
    started = time.time()
    child: Optional[subprocess.Popen] = None
    watchdog = None
    pending: list[int] = []
    workers: Optional[threading.Event] = None  # the watch of torchrun's workers

    def forward(signum, frame):
        if child is None:
            pending.append(signum)
            return
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        try:
            me = os.getpid()
            child = subprocess.Popen(command, env=env, preexec_fn=lambda: _child_setup(me))
        except OSError as err:
            say(f"cannot run {command[0]!r}: {err}")
            return 127
        for signum in pending:
            forward(signum, None)
        with _helpers_deaf():
            watchdog = start_watchdog(run_dir, child.pid, hang_bounds, say)
            workers = watch_workers(child.pid, run_dir, token)
        while True:
            # Waited on in short slices, not in one waitpid: a signal whose C handler runs after
            # waitpid released the GIL but before the call blocks interrupts nothing, and its Python
            # handler (the forward) would wait for the command's own end. Each slice returns to bytecode.
            try:
                returncode = child.wait(timeout=WAIT_SLICE_S)
                break
            except subprocess.TimeoutExpired:
                continue
    finally:
        if watchdog is not None:
            watchdog.stop()
        if workers is not None:
            workers.set()
        for s, handler in previous.items():
            signal.signal(s, handler)
        if watcher is not None:
            watcher.stop()  # the checkpoint is made: on Azure, approve the events acted on
    command_code = 128 - returncode if returncode < 0 else returncode
    record = read_exit_record(run_dir, token=token, since=started)
    if record is None:
        say(f"no exit record from the trainer; exiting with the command's code {command_code}")
        return command_code
    code = record["code"]
    if code == USAGE and command_code == 0:
        return code  # a configuration refusal, handed over quietly: the trainer's one line ends the log
    if code != command_code:
        say(f"trainer exit {code} ({describe(code)}: {record.get('reason')}); {command[0]} exited {command_code}")
    return code


def _watch(notices: NoticeFile, say):
    """Start the node's notice watcher delivering to `notices`; None without a cloud to watch."""
    try:
        run_dir = notices.path.parent
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        notices.clear()
        from skyspot.trainer.notice import watch_for

        return watch_for(notices)
    except Exception as err:  # never stop the trainer from starting: SIGTERM still saves it
        say(f"not watching for shutdown warnings: {err}")
        return None


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, command = parse_args(argv)
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else USAGE
    logging.basicConfig(level=logging.WARNING, format="[skyspot.supervise] %(message)s")  # the watcher's lines
    return run(args.run_dir, command, args.grace, hang_bounds=watchdog_bounds(args))


if __name__ == "__main__":
    raise SystemExit(main())
