"""End to end under `torchrun --nproc_per_node 2` (gloo): an evaluation interrupted by a preemption is
redone on the next start, never half-counted, and every evaluation equals the uninterrupted run's.

    eval_reference   tiny, 8 steps, eval.fraction held out, evaluated at steps 4 and 8, uninterrupted
    preempted   SIGTERM to torchrun while rank 0 is inside the evaluation of step 4
                -> the evaluation is abandoned, both ranks save step 4, exit 75
                -> the next start resumes at 4, evaluates step 4 again, trains to 8, evaluates 8

Both runs are shared by the tests below (module-scoped).
"""

from __future__ import annotations

import json

import psutil
import pytest

from skyspot.trainer.exit_codes import PREEMPTED
from tests.trainer.launch import events, finish, log_text, start, wait_for_file

pytestmark = pytest.mark.slow

EVAL = [
    "train.steps=8",
    "checkpoint.every_steps=4",
    "train.log_every=4",
    "eval.fraction=0.05",
    "eval.every_steps=4",
    "eval.batches=2",
]


@pytest.fixture(scope="module")
def eval_reference(tmp_path_factory):
    """The eval recipe uninterrupted (not the session `reference`: this one holds out and evaluates)."""
    run_dir = tmp_path_factory.mktemp("eval") / "reference"
    code = finish(start(run_dir, EVAL))
    assert code == 0, log_text(run_dir)
    return run_dir


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("eval") / "preempted"
    faults = run_dir.parent / "faults"
    proc = start(
        run_dir, EVAL, log_name="start1", SKYSPOT_FAULT="eval_batch@4/0:pause=3", SKYSPOT_FAULT_DIR=str(faults)
    )
    wait_for_file(faults / "eval_batch@4.rank0", proc)
    torchrun = psutil.Process(proc.pid).children()[0]
    torchrun.send_signal(15)  # SIGTERM, as SkyPilot's preemption path sends it
    codes = [finish(proc)]
    codes.append(finish(start(run_dir, EVAL, log_name="start2")))
    return run_dir, codes


def _evals(run_dir, attempt=None) -> list[tuple[int, float, float, int]]:
    return [
        (e["step"], e["loss"], e["perplexity"], e["tokens"])
        for e in events(run_dir, "eval")
        if attempt is None or e["attempt"] == attempt
    ]


def test_an_eval_interrupted_by_a_preemption_is_redone_and_equals_the_uninterrupted_runs(eval_reference, preempted):
    run_dir, codes = preempted
    assert codes == [PREEMPTED, 0], log_text(run_dir, "start1") + log_text(run_dir, "start2")
    # the interrupted start recorded no evaluation of step 4, and saved step 4 itself
    assert _evals(run_dir, attempt=1) == []
    assert [e["step"] for e in events(run_dir, "emergency_checkpoint")] == [4]
    # the next start evaluated step 4 again, then 8: each step once, each bitwise the reference's
    expected = _evals(eval_reference)
    assert [e[0] for e in expected] == [4, 8]
    assert _evals(run_dir) == _evals(run_dir, attempt=2) == expected
    assert all(e["rank"] == 0 and e["batches"] == 2 and e["seconds"] > 0 for e in events(run_dir, "eval"))
    # evaluating (or abandoning an evaluation) changes nothing of the training
    steps = {e["step"]: e["loss"] for e in events(run_dir, "step")}
    assert steps == {e["step"]: e["loss"] for e in events(eval_reference, "step")}


def test_final_records_the_last_evaluation(eval_reference, preempted):
    run_dir, _ = preempted
    last = events(eval_reference, "eval")[-1]
    for directory in (eval_reference, run_dir):
        metadata = json.loads((directory / "final" / "skyspot.json").read_text())
        assert metadata == {
            "step": 8,
            "eval": {k: last[k] for k in ("step", "loss", "perplexity", "tokens", "batches")},
        }
    assert "eval step 8 | loss" in log_text(eval_reference)
