"""Imports run one way (docs/architecture.md, "Arrows point down"): the trainer runs on every node and
imports only the trainer and the contracts it shares with the CLI side; the CLI side reaches into the
trainer only through the trainer's public contracts named here. Every module of the package is read
with `ast` (lazy imports inside functions count too), nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import skyspot

PACKAGE = Path(skyspot.__file__).parent

# What the trainer may import from outside skyspot/trainer/, and why each.
TRAINER_MAY_IMPORT = {
    "skyspot.events": "the event log contract the trainer writes and the planner reads back",
    "skyspot.attempts": "how events split into attempts (the preemption rate of trainer/interval.py)",
    "skyspot.storage": "the store: every cloud's object store behind one URI protocol",
    "skyspot.recipe": "the recipe the node trains, loaded with the same rules as the CLI",
    "skyspot.errors": "the project's error types (exit 2 for usage errors, 1 for the rest)",
    "skyspot.clouds": "cloud facts: notice windows, poll periods, bandwidths, preemption priors",
    "skyspot.hub": "the Hugging Face hub, where a node fetches the base model and its tokenizer",
    "skyspot.sizing": "a recipe's state size, which the first interval plan (initial_plan) divides by bandwidth",
    "skyspot.ports": "a free loopback port for the standalone trainer's rendezvous (no torchrun)",
}

# The trainer's public contracts, the only trainer modules the rest of the package may import, and why.
TRAINER_CONTRACTS = {
    "skyspot.trainer.exit_codes": "what the trainer's exit codes mean (the local controller recovers on 75)",
    "skyspot.trainer.rundir": "the run directory's layout and attempt counter, shared with the local controller",
    "skyspot.trainer.files": "reading the run directory's JSON files as the trainer wrote them (local controller)",
    "skyspot.trainer.data": "which data sources a run can read, checked by preflight before anything is paid for",
    "skyspot.trainer.interval": "initial_plan: the interval the trainer starts with, which the plan's egress counts",
}

# Leaves: both sides import them, so they import (almost) nothing of skyspot themselves.
LEAVES = {"skyspot.clouds": {"skyspot.errors"}, "skyspot.attempts": set(), "skyspot.ports": set()}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every skyspot module `path` imports, as dotted names (`from skyspot import hub` -> skyspot.hub)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package up
                module = _module_name(path)
                parts = (module if path.name == "__init__.py" else module.rpartition(".")[0]).split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                # `from skyspot import hub` names a module; `from skyspot.cost import run_cost` a function.
                found.add(candidate if (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(".py").exists()
                          or (PACKAGE.parent / candidate.replace(".", "/")).is_dir() else base)
    return {name for name in found if name == "skyspot" or name.startswith("skyspot.")}


def _modules() -> dict[str, set[str]]:
    return {_module_name(path): _imports(path) for path in sorted(PACKAGE.rglob("*.py"))}


def _in_trainer(name: str) -> bool:
    return name == "skyspot.trainer" or name.startswith("skyspot.trainer.")


def test_the_walk_sees_the_whole_package():
    modules = _modules()
    assert {"skyspot.trainer.loop", "skyspot.cli.main", "skyspot.clouds", "skyspot.attempts"} <= set(modules)
    assert "skyspot.hub" in modules["skyspot.trainer.base"]  # `from skyspot import hub`, inside a function


def test_the_trainer_imports_only_the_trainer_and_the_shared_contracts():
    wrong = {f"{module} imports {name}" for module, names in _modules().items() if _in_trainer(module)
             for name in names if not _in_trainer(name) and name not in TRAINER_MAY_IMPORT and name != "skyspot"}
    assert not wrong, "the trainer reaches into the CLI side:\n" + "\n".join(sorted(wrong))


def test_outside_the_trainer_only_its_public_contracts_are_imported():
    wrong = {f"{module} imports {name}" for module, names in _modules().items() if not _in_trainer(module)
             for name in names if _in_trainer(name) and name not in TRAINER_CONTRACTS}
    assert not wrong, "trainer internals imported from outside the trainer:\n" + "\n".join(sorted(wrong))


def test_cloud_facts_and_attempts_are_leaves():
    modules = _modules()
    for leaf, allowed in LEAVES.items():
        assert modules[leaf] <= allowed, f"{leaf} imports {sorted(modules[leaf] - allowed)}"


def test_the_rule_catches_a_trainer_module_importing_the_cli(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from skyspot.cli.common import err\n")
    assert "skyspot.cli.common" in _imports(bad) - set(TRAINER_MAY_IMPORT)


def test_nothing_below_the_cli_imports_the_cli():
    """The CLI is the thin shell on top: executors, runs, cost and the rest print through
    skyspot.console and raise skyspot.errors; none of them reaches back up into skyspot.cli."""
    wrong = {f"{module} imports {name}" for module, names in _modules().items()
             if not module.startswith("skyspot.cli") for name in names if name.startswith("skyspot.cli")}
    assert not wrong, "the arrows run upward:\n" + "\n".join(sorted(wrong))
