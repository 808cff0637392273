"""Issue 31, item 13: 20,000 overrides took more than 30 s, every overridden key compared with every other to
find the outermost ones the node gets (app/launch.py). Their time is bench/bounds.py's figure; here, that
20,000 of them give the right recipe and reach the node once each, a section beside its keys as one."""

from __future__ import annotations

from skyspot.app.launch import _trainer_overrides, build
from skyspot.recipe import load_recipe
from tests.test_hostile_input import as_the_trainer_reads_it, trainer_words

MANY = 20_000


def test_twenty_thousand_overrides_give_the_recipe_they_say():
    overrides = [f"deepspeed.extra.k{i}={i}" for i in range(MANY)] + ["train.steps=7"]
    recipe = load_recipe("tiny", overrides)
    assert recipe.train.steps == 7
    assert recipe.deepspeed.extra == {f"k{i}": i for i in range(MANY)}
    words = _trainer_overrides(recipe, overrides, {}, None)
    assert sorted(words) == sorted(overrides)  # none hides another: each reaches the node, once


def test_a_section_among_thousands_of_its_keys_reaches_the_node_once():
    overrides = [f"deepspeed.extra.k{i}={i}" for i in range(2_000)] + ["deepspeed.extra={a: 1}"]
    built = build("tiny", overrides)
    assert [w for w in trainer_words(built.task) if w.startswith("deepspeed")] == ["deepspeed.extra={a: 1}"]
    assert as_the_trainer_reads_it(built.task).deepspeed.extra == {"a": 1}
