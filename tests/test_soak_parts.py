"""A soak run in parts (scripts/random_kills.py --part K/N, --merge): every lane of the plan in exactly one
part, and the parts' results joined only when they are the parts of one plan, at one commit, against equal
reference runs. The runs themselves are tests/reliability/test_random_kills.py's (slow); here the plan's
split and the merge's checks, on results built as the harness builds them."""

from __future__ import annotations

import json
import re
from dataclasses import asdict

import pytest

from tests.reliability.test_random_kills import harness

kills = harness()


def test_the_parts_of_a_plan_hold_every_lane_once_and_both_sides_in_each():
    plan = kills.lane_plan(46, 1000, kills.ALL_KINDS, 12)
    parts = [kills.lanes_of_part(plan, k, 6) for k in range(1, 7)]
    names = [lane.name for part in parts for lane in part]
    assert sorted(names) == sorted(lane.name for lane in plan) and len(names) == len(set(names)) == 24
    assert sum(lane.faults for part in parts for lane in part) == 1000
    for part in parts:
        assert {lane.net for lane in part} == {True, False} and len(part) == 4
    assert [lane.name for lane in parts[1]] == ["lane-1", "lane-7", "net-1", "net-7"]
    # each lane keeps the seed it has in the whole plan, so a part runs exactly the plan's faults
    assert {lane.name: lane.seed for lane in parts[1]} == {"lane-1": 47, "lane-7": 53, "net-1": 147, "net-7": 153}


def test_a_split_into_more_parts_than_lanes_is_refused():
    plan = kills.lane_plan(46, 1000, kills.ALL_KINDS, 2)
    with pytest.raises(ValueError, match="fewer than its 3 parts; give --lanes 3 or more"):
        kills.lanes_of_part(plan, 1, 3)
    for bad in ("0/3", "4/3", "3", "a/b", "1/"):
        with pytest.raises(ValueError, match="expected K/N"):
            kills.parse_part(bad)


def part_doc(k: int, n: int = 2, *, commit="abc123", digest="d" * 64, violations=(), equal=True, **changes) -> dict:
    r = kills.Result(46, 40, 168, 1, 3, True, kinds=list(kills.ALL_KINDS))
    r.part, r.plan_faults, r.lanes_per_side, r.commit, r.reference_sha256 = f"{k}/{n}", 40, n, commit, digest
    r.kills = [
        kills.Kill(number=i, kind="crash", target="rank-1", attempt=1, resumed_from=3, planned="") for i in (1, 2)
    ]
    r.starts, r.resumes, r.steps_compared, r.seconds = 3, 2, 100 + k, 1000.0 * k
    r.violations, r.final_equal, r.final_code = list(violations), equal, 0
    r.lanes = [f"lane-{k - 1} (seed {45 + k}, 2 faults of crash, bitwise, 900 s)"]
    return {**asdict(r), "per_kind": r.per_kind(), "ok": r.ok, **changes}


def test_parts_merge_into_the_whole_plan():
    out = kills.merge_parts([part_doc(2), part_doc(1)])
    assert out.ok and out.parts == 2 and out.kills_planned == 40 and len(out.kills) == 4
    assert out.starts == 6 and out.steps_compared == 203 and out.seconds == 3000.0
    assert out.lanes[0].startswith("part 1/2: lane-0") and out.lanes[1].startswith("part 2/2: lane-1")
    assert "(2 parts one after another, 2 lanes in all, at abc123)" in out.summary()
    assert out.per_kind()["crash"]["count"] == 4


def test_parts_of_machines_whose_references_differ_merge_and_say_so():
    """Another session's machine runs its own reference; where its CPU rounds differently, that reference ends
    elsewhere, and each part's lanes were compared with their own machine's: counted, not refused."""
    out = kills.merge_parts([part_doc(1), part_doc(2, digest="e" * 64)])
    assert out.ok and out.reference_variants == 2 and out.reference_sha256 == f"{'d' * 64} {'e' * 64}"
    assert "the parts' reference runs ended with 2 different parameter sets" in out.summary()
    assert "different parameter sets" not in kills.merge_parts([part_doc(1), part_doc(2)]).summary()


def test_a_part_that_failed_fails_the_whole():
    out = kills.merge_parts([part_doc(1), part_doc(2, violations=["attempt 3 step 9: loss differs"], equal=False)])
    assert not out.ok and out.violations == ["part 2/2: attempt 3 step 9: loss differs"] and not out.final_equal


@pytest.mark.parametrize(
    "docs, message",
    [
        ([part_doc(1)], r"parts of 2: missing \[2\]"),
        ([part_doc(1), part_doc(1)], r"missing \[2\]; given twice \[1\]"),
        ([part_doc(1), part_doc(2, commit="fff999")], "the parts differ in commit"),
        ([part_doc(1, commit="abc+dirty"), part_doc(2, commit="abc+dirty")], "uncommitted changes .abc.dirty."),
        ([part_doc(1, commit=""), part_doc(2, commit="")], "no git commit"),
        ([part_doc(1, digest=""), part_doc(2)], "reference run is unrecorded"),
        ([part_doc(1), part_doc(2, steps=200)], "the parts differ in steps"),
        ([part_doc(1), part_doc(2, kinds=["step"])], "the parts differ in kinds"),
        ([part_doc(1), part_doc(2, plan_faults=41)], "the parts differ in plan_faults"),
        ([part_doc(1), part_doc(2, lanes_per_side=4)], "the parts differ in lanes_per_side"),
        ([part_doc(1), [part_doc(2)]], "not a JSON object"),
        ([part_doc(1), part_doc(2, 3)], "parts of different splits"),
        ([part_doc(1), {**part_doc(2), "part": ""}], "not a part"),
    ],
)
def test_results_that_are_not_the_parts_of_one_plan_are_refused(docs, message):
    with pytest.raises(kills.PartsError, match=message):
        kills.merge_parts(docs)


def test_the_command_merges_parts_and_exits_as_the_whole_would(tmp_path, capsys):
    files = []
    for k, doc in ((1, part_doc(1)), (2, part_doc(2))):
        files.append(tmp_path / f"part-{k}.json")
        files[-1].write_text(json.dumps(doc))
    assert kills.main(["--merge", *map(str, files), "--json", str(tmp_path / "all.json")]) == 0
    out = capsys.readouterr().out
    assert "seed 46: 4 faults (4 crash)" in out and "lane part 2/2: lane-1" in out
    assert json.loads((tmp_path / "all.json").read_text())["parts"] == 2
    files[1].write_text(json.dumps(part_doc(2, violations=["lost step 7"], equal=False)))
    assert kills.main(["--merge", *map(str, files)]) == 1
    assert "VIOLATION: part 2/2: lost step 7" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--merge", "{missing}"], "--merge: .*No such file"),
        (["--merge", "{garbage}"], "--merge: Expecting value"),
        (["--merge", "{shapeless1}", "{shapeless2}"], "--merge: not a part result of this harness"),
        (["--reference", "{missing}"], "--reference .*nope.json: no final/model.safetensors"),
        (["--part", "7/6", "--lanes", "6"], "expected K/N"),
        (["--part", "1/6", "--lanes", "2", "--kinds", "step"], "--part: part 1/6: the plan has 2 node lane"),
    ],
)
def test_bad_arguments_get_one_line_and_exit_2(tmp_path, capsys, argv, message):
    (tmp_path / "garbage").write_text("not json")
    names = dict(missing=tmp_path / "nope.json", garbage=tmp_path / "garbage")
    for k in (1, 2):  # parts by their names, and nothing else of a result
        names[f"shapeless{k}"] = tmp_path / f"shapeless{k}"
        names[f"shapeless{k}"].write_text(json.dumps({"part": f"{k}/2", "commit": "abc", "reference_sha256": "d"}))
    argv = [a.format(**names) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        kills.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # argparse's usage line, then the one-line error
    assert "error: " in err and re.search(message, err), err
