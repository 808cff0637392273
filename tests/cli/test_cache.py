"""`render` and `recipes` repeat from a cache (skyspot/cli/cache.py): the same output, and a miss on any change."""

from __future__ import annotations

import os
import shutil
import stat
import sys

import yaml
from typer.testing import CliRunner

from skyspot.cli import cache
from skyspot.cli.main import app
from skyspot.ledger import skyspot_home
from tests.conftest import REPO

runner = CliRunner()


def invoke(*args, env=None):
    return runner.invoke(app, list(args), env=env, catch_exceptions=False)


def entries() -> list:
    folder = skyspot_home() / "cache"
    return sorted(folder.iterdir()) if folder.is_dir() else []


def test_a_repeated_render_is_served_from_the_cache_with_the_same_text(monkeypatch):
    first = invoke("render", "tiny")
    assert first.exit_code == 0 and len(entries()) == 1
    # A hit never loads the recipe models: make loading them fail, and the render still answers.
    import skyspot.app.launch

    monkeypatch.setattr(skyspot.app.launch, "build", lambda *a, **k: (_ for _ in ()).throw(AssertionError("built")))
    second = invoke("render", "tiny")
    assert second.exit_code == 0 and second.stdout == first.stdout
    assert [p.stat().st_mode & 0o777 for p in entries()] == [0o600]
    assert stat.S_IMODE((skyspot_home() / "cache").stat().st_mode) == 0o700


def test_any_change_of_input_is_a_miss(tmp_path, monkeypatch):
    base = invoke("render", "tiny").stdout
    assert yaml.safe_load(invoke("render", "tiny", "train.steps=40").stdout) != yaml.safe_load(base)
    assert "40" in invoke("render", "tiny", env={"SKYSPOT_TRAIN__STEPS": "40"}).stdout
    recipe = tmp_path / "mine.yaml"
    recipe.write_text((REPO / "skyspot" / "recipes" / "tiny.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    assert invoke("render", "mine.yaml").exit_code == 0
    assert len(entries()) == 4
    recipe.write_text(recipe.read_text().replace("steps: 200", "steps: x"))  # now invalid: must not be served
    assert invoke("render", "mine.yaml").exit_code == 2
    assert len(entries()) == 4  # a failure is not stored


def test_an_entry_whose_wheel_is_gone_is_rebuilt():
    first = invoke("render", "tiny").stdout
    shutil.rmtree(skyspot_home() / "packages")
    again = invoke("render", "tiny")
    assert again.exit_code == 0 and again.stdout == first
    assert list((skyspot_home() / "packages").glob("*/*.whl")), "the wheel the task mounts was built again"


def test_a_changed_package_file_is_a_miss(monkeypatch):
    before = cache.key("render", ["tiny"])
    recipe = REPO / "skyspot" / "recipes" / "tiny.yaml"
    stamp = recipe.stat()
    try:
        os.utime(recipe, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1_000_000))
        assert cache.key("render", ["tiny"]) != before
    finally:
        os.utime(recipe, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert cache.key("render", ["tiny"]) == before


def test_recipes_from_the_cache_match_a_fresh_listing():
    fresh = invoke("recipes", "--json").stdout
    again = invoke("recipes", "--json").stdout
    assert fresh == again and len(entries()) == 1


def test_an_unusable_cache_is_ignored(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / "cache").write_text("a file where the cache folder should be")
    monkeypatch.setenv("SKYSPOT_HOME", str(home))
    result = invoke("render", "tiny")
    assert result.exit_code == 0 and result.stdout.startswith("#")
    (home / "cache").unlink()
    (home / "cache").mkdir()
    assert invoke("render", "tiny").exit_code == 0
    for path in (home / "cache").iterdir():
        path.write_text("{not json")
    assert invoke("render", "tiny").stdout == result.stdout


def test_a_fifo_named_as_the_recipe_is_never_read(tmp_path, monkeypatch):
    if sys.platform == "win32":  # pragma: no cover
        return
    monkeypatch.chdir(tmp_path)
    os.mkfifo(tmp_path / "pipe.yaml")
    key = cache.key("render", ["pipe.yaml"], files=["pipe.yaml"])  # returns: the FIFO is not opened
    assert len(key) == 40
