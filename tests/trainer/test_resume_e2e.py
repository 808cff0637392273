"""End to end under `torchrun --nproc_per_node 2` (gloo): preempted runs match an uninterrupted one.

One uninterrupted reference run, and one run stopped three times and resumed each time:

    start 1   SIGTERM to ONE worker (rank 1) at step 6      -> both ranks save step 6, exit 75
    start 2   resumes at 6; SIGTERM to torchrun at step 10  -> saves step 10, exit 75
    start 3   resumes at 10; interval checkpoint 12 commits; SIGKILL of the whole node while
              step 16's checkpoint is half-written (files and manifest, no marker)
    start 4   skips the half-written step_16, resumes at 12, finishes

All starts go through `python -m skyspot.trainer.supervise`, as on a SkyPilot node. The runs are
shared by the tests below (module-scoped; the reference is session-scoped, conftest.py).
"""

from __future__ import annotations

import os
import shutil
import signal

import psutil
import pytest
import torch
from safetensors.torch import load_file

from skyspot.trainer import manifest as mf
from skyspot.trainer.exit_codes import NO_VALID_CHECKPOINT, PREEMPTED
from tests.trainer.launch import TINY, events, finish, log_text, start, wait_for_file

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """The interrupted run: run dir plus each start's exit code."""
    run_dir = tmp_path_factory.mktemp("e2e") / "preempted"
    faults = run_dir.parent / "faults"
    codes = []

    # start 1: SIGTERM to rank 1 only, while it pauses at the end of step 6.
    proc = start(run_dir, TINY, log_name="start1", SKYSPOT_FAULT="step_end@6/1:pause=3", SKYSPOT_FAULT_DIR=str(faults))
    pid = int(wait_for_file(faults / "step_end@6.rank1", proc))
    os.kill(pid, signal.SIGTERM)
    codes.append(finish(proc))

    # start 2: SIGTERM to torchrun itself (the supervisor's child) while rank 0 pauses at step 10.
    proc = start(run_dir, TINY, log_name="start2", SKYSPOT_FAULT="step_end@10/0:pause=3", SKYSPOT_FAULT_DIR=str(faults))
    wait_for_file(faults / "step_end@10.rank0", proc)
    torchrun = psutil.Process(proc.pid).children()[0]
    assert "torchrun" in " ".join(torchrun.cmdline())
    torchrun.send_signal(signal.SIGTERM)
    codes.append(finish(proc))

    # start 3: SIGKILL of the node while step 16's checkpoint has its files and manifest but no marker.
    proc = start(
        run_dir, TINY, log_name="start3", SKYSPOT_FAULT="before_marker@16:pause=60", SKYSPOT_FAULT_DIR=str(faults)
    )
    wait_for_file(faults / "before_marker@16.rank0", proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the supervisor; torchrun and the workers die with it
    codes.append(finish(proc))
    psutil.wait_procs([p for p in psutil.process_iter() if str(run_dir) in " ".join(_cmdline(p))], timeout=30)

    # start 4: no interruption.
    codes.append(finish(start(run_dir, TINY, log_name="start4")))
    return run_dir, codes


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.Error, OSError):
        return []


def _losses(run_dir, attempt=None) -> dict[int, tuple[float, float]]:
    return {
        e["step"]: (e["loss"], e["lr"]) for e in events(run_dir, "step") if attempt is None or e["attempt"] == attempt
    }


def test_one_rank_sigterm_makes_every_rank_save_and_exit_75(preempted):
    run_dir, codes = preempted
    assert codes[0] == PREEMPTED, log_text(run_dir, "start1")
    signals = [e for e in events(run_dir, "signal") if e["attempt"] == 1]
    assert [(e["rank"], e["name"]) for e in signals] == [(1, "SIGTERM")]
    emergency = [e for e in events(run_dir, "emergency_checkpoint") if e["attempt"] == 1]
    assert [e["step"] for e in emergency] == [6]
    assert 0 <= emergency[0]["signal_to_commit_seconds"] < 30
    exits = [e for e in events(run_dir, "exit") if e["attempt"] == 1]
    assert [(e["code"], e["step"]) for e in exits] == [(PREEMPTED, 6)]


def test_next_start_resumes_at_exactly_the_emergency_step(preempted):
    run_dir, _ = preempted
    resumes = {e["attempt"]: e["step"] for e in events(run_dir, "resume")}
    assert resumes[2] == 6 and resumes[3] == 10
    assert min(_losses(run_dir, attempt=2)) == 7  # nothing repeated, nothing skipped


def test_sigterm_to_torchrun_saves_and_exits_75(preempted):
    run_dir, codes = preempted
    assert codes[1] == PREEMPTED, log_text(run_dir, "start2")
    assert [e["step"] for e in events(run_dir, "emergency_checkpoint") if e["attempt"] == 2] == [10]


def test_half_written_checkpoint_is_ignored_after_sigkill(preempted):
    run_dir, codes = preempted
    assert codes[2] != 0
    resume = [e for e in events(run_dir, "resume") if e["attempt"] == 4][0]
    assert resume["step"] == 12
    assert any("step_16" in line and "incomplete" in line for line in resume["skipped"])
    assert codes[3] == 0, log_text(run_dir, "start4")


def test_preempted_run_matches_uninterrupted_run_bitwise(reference, preempted):
    run_dir, codes = preempted
    assert codes[3] == 0
    expected = _losses(reference)
    assert sorted(expected) == list(range(1, 17))
    for attempt in (1, 2, 3, 4):
        got = _losses(run_dir, attempt)
        assert got, f"start {attempt} logged no steps"
        assert got == {step: expected[step] for step in got}, f"start {attempt} diverged"
    ours, theirs = (
        load_file(run_dir / "final" / "model.safetensors"),
        load_file(reference / "final" / "model.safetensors"),
    )
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_checkpoints_are_committed_with_manifest_and_retention(reference):
    verdicts = mf.scan(reference / "checkpoints")
    assert [(v.step, v.state) for v in verdicts] == [(16, "valid"), (12, "valid"), (8, "valid")]  # keep=3
    manifest = verdicts[0].manifest
    assert manifest["world_size"] == 2 and manifest["samples"] == 16 * 8 and manifest["data"]["samples_consumed"] == 128
    assert set(manifest["files"]) >= {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "trainer_state_rank_1.pt"}
    ends = events(reference, "checkpoint_end")
    assert [e["step"] for e in ends] == [4, 8, 12, 16]
    assert all(e["blocked_seconds"] >= 0 and e["write_seconds"] > 0 and e["bytes"] > 0 for e in ends)
    assert (reference / "checkpoints" / "latest").read_text() == "step_16"


def test_final_model_loads_generates_and_equals_the_last_checkpoint(reference):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    from skyspot.trainer.model import ByteTokenizer

    model = AutoModelForCausalLM.from_pretrained(reference / "final")
    tokenizer = ByteTokenizer.from_pretrained(reference / "final")
    prompt = torch.tensor([tokenizer.encode("abcabcabc")])
    out = model.generate(prompt, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, prompt.shape[1] :])
    assert out.shape[1] > prompt.shape[1] and isinstance(text, str)

    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(reference / "checkpoints"), tag="step_16")
    final = model.state_dict()
    for name, tensor in fp32.items():
        assert torch.equal(final[name], tensor), name


def test_run_whose_checkpoints_are_all_corrupt_exits_3_and_starts_nothing(reference, tmp_path):
    run_dir = tmp_path / "corrupt"
    shutil.copytree(reference, run_dir)
    for step_dir in (run_dir / "checkpoints").glob("step_*"):
        with open(step_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt", "r+b") as f:
            f.seek(100)
            f.write(b"\0" * 8)
    code = finish(start(run_dir, TINY))
    assert code == NO_VALID_CHECKPOINT, log_text(run_dir)
    assert "none is usable" in log_text(run_dir) and "--fresh" in log_text(run_dir)
    assert not [e for e in events(run_dir, "step") if e["attempt"] == 2]
