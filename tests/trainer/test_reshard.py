"""Resuming at another world size, the parts that need no training: the batch re-split, the sample
order across the change, the universal-conversion cache and gathering every rank's files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from skyspot.errors import CheckpointError
from skyspot.trainer import reshard
from skyspot.trainer.checkpoint import resharding
from skyspot.trainer.data import DataOrder, rebatch


@pytest.mark.parametrize(
    "global_batch, micro, accum, dp, expected",
    [
        (8, 4, 1, 2, (4, 1)),  # unchanged world: the recipe's split
        (8, 4, 1, 1, (4, 2)),  # 2 -> 1 rank: accumulate twice
        (4, 4, 1, 2, (2, 1)),  # 1 -> 2 ranks: halve the micro batch
        (64, 8, 2, 4, (8, 2)),  # 4 ranks wrote 8 x 2 x 4 = 64: unchanged
        (64, 8, 2, 2, (8, 4)),  # 4 -> 2 nodes of 1 rank
        (48, 8, 1, 3, (8, 2)),  # 6 -> 3: 16 per rank
        (24, 8, 1, 5, (8, 1)),  # 24 does not divide by 5: the recipe's split, and a note
    ],
)
def test_rebatch_keeps_the_global_batch_whenever_it_divides(global_batch, micro, accum, dp, expected):
    got_micro, got_accum, note = rebatch(global_batch, micro, accum, dp)
    assert (got_micro, got_accum) == expected
    if global_batch % dp:
        assert note and "does not divide" in note
    else:
        assert got_micro * got_accum * dp == global_batch
        assert got_micro <= micro
        assert (note is None) == ((micro, accum) == expected)


def _step_samples(order: DataOrder, ranks: int, consumed: int) -> list[int]:
    """Every rank's samples of the step starting at `consumed`, in training order."""
    per_rank = [
        DataOrder(
            order.num_samples, order.seed, order.shuffle, r, ranks, order.micro_batch, order.grad_accum
        ).step_indices(consumed)
        for r in range(ranks)
    ]
    return sorted(int(i) for batch in per_rank for i in np.ravel(batch))


def test_across_a_world_size_change_every_step_takes_the_same_samples():
    """2 ranks x 4 for 8 steps, then 1 rank x 4 x 2 accumulations: the steps after the change train on
    exactly the samples the uninterrupted 2-rank run would have, so none is skipped or repeated."""
    before = DataOrder(100, 7, True, 0, 2, 4, 1)
    micro, accum, _ = rebatch(before.global_batch, 4, 1, 1)
    after = DataOrder(100, 7, True, 0, 1, micro, accum)
    assert after.global_batch == before.global_batch == 8
    for step in range(8, 30):  # crosses epochs (100 samples, 8 per step)
        consumed = step * 8
        assert _step_samples(after, 1, consumed) == _step_samples(before, 2, consumed)
    seen = [
        i
        for step in range(0, 25)
        for i in _step_samples(after if step >= 8 else before, 1 if step >= 8 else 2, step * 8)
    ]
    assert sorted(seen) == sorted(list(range(100)) * 2)  # 25 steps x 8 = two epochs: each sample twice


def test_resharding_compares_the_writers_world_size():
    assert resharding({"world_size": 2}, 1) and resharding({"world_size": 1}, 2)
    assert not resharding({"world_size": 2}, 2)
    assert not resharding({}, 2)  # an old manifest without the field: as written
    # The same ranks on another number of nodes: each node holds only its own ranks' files.
    assert resharding({"world_size": 2, "num_nodes": 2}, 2, 1)
    assert not resharding({"world_size": 2, "num_nodes": 2}, 2, 2)


def _step_dir(path, ranks):
    path.mkdir(parents=True)
    for r in ranks:
        (path / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"o%d" % r)
        (path / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt").write_bytes(b"m%d" % r)
    (path / "manifest.json").write_text(json.dumps({"step": 8, "world_size": 4}))
    return path


def test_gather_uses_the_step_dir_when_it_holds_every_rank(tmp_path):
    step_dir = _step_dir(tmp_path / "step_8", range(2))
    assert reshard.ranks_present(step_dir) == {0, 1}
    assert reshard.gather(step_dir, 2, 1, None, tmp_path / "staging") == step_dir


def test_gather_completes_another_nodes_part_from_the_store_or_says_what_is_missing(tmp_path):
    step_dir = _step_dir(tmp_path / "node0" / "step_8", [0, 1])
    with pytest.raises(CheckpointError, match=r"missing \[2, 3\].*storage.store"):
        reshard.gather(step_dir, 4, 2, None, tmp_path / "staging")

    fetched = []

    def fetch(node, directory):  # the store's copy of node `node`'s part (durable.StoreTier.fetch_part)
        fetched.append(node)
        return _step_dir(directory, [2 * node, 2 * node + 1])

    staging = reshard.gather(step_dir, 4, 2, fetch, tmp_path / "universal" / ".gather-step_8")
    assert reshard.ranks_present(staging) == {0, 1, 2, 3}
    assert (staging / "zero_pp_rank_3_mp_rank_00_optim_states.pt").read_bytes() == b"o3"
    assert (staging / "zero_pp_rank_0_mp_rank_00_optim_states.pt").read_bytes() == b"o0"
    assert fetched == [1]  # node 0's part (ranks 0 and 1) was here
    assert sorted(p.name for p in staging.parent.iterdir()) == [".gather-step_8"]  # downloads cleaned up

    def short(node, directory):
        return _step_dir(directory, [2])

    with pytest.raises(CheckpointError, match=r"lacks ranks \[3\]"):
        reshard.gather(step_dir, 4, 2, short, tmp_path / "universal" / ".gather-step_8")


def test_the_conversion_cache_is_keyed_by_the_source_manifest(tmp_path):
    target = reshard.universal_root(tmp_path) / "step_8"
    target.mkdir(parents=True)
    assert reshard.cached(tmp_path, 8, "abc") is None  # no CONVERTED: a cut conversion is never read
    (target / reshard.CONVERTED).write_text(json.dumps({"step": 8, "manifest_sha256": "abc"}))
    assert reshard.cached(tmp_path, 8, "abc") == target
    assert reshard.cached(tmp_path, 8, "def") is None  # another checkpoint of the same step (after --fresh)
    assert reshard.cached(tmp_path, 12, "abc") is None


@pytest.mark.parametrize(
    "content, message",
    [
        ("bytes", "refusing .*not a file the weights-only loader reads"),  # vetted before DeepSpeed sees it
        ("torch", "universal conversion failed"),  # loads weights-only, but is no DeepSpeed checkpoint
    ],
)
def test_a_failed_conversion_is_one_line_and_leaves_no_cache(tmp_path, content, message):
    source = _step_dir(tmp_path / "step_8", [0, 1])
    if content == "torch":
        import torch

        for path in source.glob("*.pt"):
            torch.save({"junk": torch.zeros(2)}, path)
    with pytest.raises(CheckpointError, match=message) as err:
        reshard.convert(source, tmp_path, 8, "abc")
    assert "\n" not in str(err.value)
    assert [p.name for p in reshard.universal_root(tmp_path).iterdir()] == []


def test_the_conversion_clears_older_caches_but_never_its_own_source(tmp_path):
    root = reshard.universal_root(tmp_path)
    (root / "step_4").mkdir(parents=True)  # an older conversion
    staging = _step_dir(root / ".gather-step_8", [0, 1])  # what gather() assembled
    with pytest.raises(CheckpointError):
        reshard.convert(staging, tmp_path, 8, "abc")  # fake files: DeepSpeed refuses them
    assert not (root / "step_4").exists()
    assert reshard.ranks_present(staging) == {0, 1}
