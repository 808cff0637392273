"""Coverage-guided fuzzing (atheris, libFuzzer) of the recipe loader and the override parser.

    python -m tests.fuzz.recipe_targets recipe CORPUS_DIR -runs=4000 -seed=1 -rss_limit_mb=500 -timeout=2
    python -m tests.fuzz.recipe_targets overrides CORPUS_DIR -runs=4000 ...

tests/fuzz/test_fuzz.py runs both for a fixed number of inputs in CI. What must hold for any input:
- `recipe`: the bytes as a recipe file load into a Recipe, or raise UsageError (one line for the CLI);
  nothing else, within libFuzzer's per-input -timeout and -rss_limit_mb;
- `overrides`: up to three `key=value` strings and one SKYSPOT_* variable on top of `tiny` load or raise
  UsageError; and what loads travels: the `key=value` texts `override_texts` puts on the trainer's
  command line load back, on their own, to the same recipe (the node must train what was checked).
Any other exception is a crash libFuzzer reports with the input that caused it.
"""

from __future__ import annotations

import os
import sys
import tempfile

import atheris

with atheris.instrument_imports(include=["skyspot"]):
    from skyspot.errors import UsageError
    from skyspot.recipe import load_recipe, override_texts

_FILE = os.path.join(tempfile.mkdtemp(prefix="skyspot-fuzz-"), "recipe.yaml")


def recipe(data: bytes) -> None:
    with open(_FILE, "wb") as handle:
        handle.write(data)
    try:
        load_recipe(_FILE, environ={})
    except UsageError as error:
        assert str(error).strip(), "an error with nothing to say"


def overrides(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    pairs = [fdp.ConsumeUnicodeNoSurrogates(40) for _ in range(fdp.ConsumeIntInRange(0, 3))]
    environ = {}
    if fdp.ConsumeBool():
        environ["SKYSPOT_" + fdp.ConsumeUnicodeNoSurrogates(24)] = fdp.ConsumeUnicodeNoSurrogates(24)
    try:
        loaded = load_recipe("tiny", pairs, environ=environ)
    except UsageError:
        return
    texts = list(override_texts(pairs, environ=environ).values())
    again = load_recipe("tiny", texts, environ={})
    assert again == loaded, (pairs, environ, texts)


TARGETS = {"recipe": recipe, "overrides": overrides}


def main() -> None:
    target = TARGETS[sys.argv[1]]
    atheris.Setup([sys.argv[0], *sys.argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
