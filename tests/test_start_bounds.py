"""Bounds from one place (issue 29): the watchdog's first-step bound of a start is at least what the I/O
plan allows that recipe's model and data, because one function computes both."""

from __future__ import annotations

from skyspot.recipe import load_recipe
from skyspot.start_bounds import IO_TIMEOUT_S, LOAD_MARGIN_S, PLANNED_BANDWIDTH_BPS, start_bounds
from skyspot.task.render import run_script


def test_llama70b_gets_a_first_step_bound_past_its_io_plan():
    recipe = load_recipe("llama70b", environ={})
    bounds = start_bounds(recipe, environ={})
    assert 141e9 < bounds.download_bytes < 141.2e9  # 70.55e9 bf16 weights
    assert bounds.download_seconds == round(bounds.download_bytes / PLANNED_BANDWIDTH_BPS, 1) > 7000
    assert bounds.io_seconds == IO_TIMEOUT_S  # the I/O group's 2 h covers the 7055 s download
    assert (
        bounds.first_step_seconds >= bounds.io_seconds + LOAD_MARGIN_S
    )  # the watchdog waits longer than the I/O group
    assert recipe.resilience.first_step_seconds == 3600 < bounds.first_step_seconds  # the recipe's 1 h alone was less
    # The rendered run hands the watchdog that bound, not the recipe's 3600.
    assert f"--first-step-bound {bounds.first_step_seconds:g} " in run_script(recipe, "llama70b", [])


def test_a_model_that_downloads_quickly_keeps_the_recipes_bound():
    for name, overrides in (("tiny", ["resilience.first_step_seconds=900"]), ("llama8b", [])):
        recipe = load_recipe(name, overrides, environ={})
        bounds = start_bounds(recipe, environ={})
        assert bounds.first_step_seconds == recipe.resilience.first_step_seconds, name
        assert bounds.io_seconds == IO_TIMEOUT_S


def test_a_larger_download_than_two_hours_raises_the_io_wait_and_the_bound_together():
    recipe = load_recipe("llama70b", environ={})
    bounds = start_bounds(recipe, environ={"SKYSPOT_MODEL_PARAMS": "405e9"})  # 810 GB: 11 h at 20 MB/s
    assert abs(bounds.io_seconds - bounds.download_seconds) < 1 and bounds.io_seconds > 40000
    assert bounds.first_step_seconds == bounds.io_seconds + LOAD_MARGIN_S
