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
    "skyspot.clouds": "cloud facts, one class per cloud: notice windows, metadata endpoints and paths, the notice "
    "protocol each cloud binds, bandwidths, preemption priors (standard library only)",
    "skyspot.hub": "the Hugging Face hub, where a node fetches the base model and its tokenizer",
    "skyspot.sizing": "a recipe's state size, which the first interval plan (initial_plan) divides by bandwidth",
    "skyspot.node_host": "the node's driver, skyspot's venv and setup's record in it, which the node event reports",
    "skyspot.start_bounds": "the I/O group's timeout, from the same plan as the watchdog's first-step bound",
    "skyspot.ports": "a free loopback port for the standalone trainer's rendezvous (no torchrun)",
    "skyspot.statuses": "a run's status (SkyPilot's managed-job names), with is_terminal and is_failed",
    "skyspot.str_enum": "the string-enum base of the contracts' types, on the node's Python 3.10",
}

# The trainer's public contracts, the only trainer modules the rest of the package may import, and why.
TRAINER_CONTRACTS = {
    "skyspot.trainer.exit_codes": "what the trainer's exit codes mean (the local controller recovers on 75)",
    "skyspot.trainer.rundir": "the run directory's layout and attempt counter, shared with the local controller",
    "skyspot.trainer.files": "reading the run directory's JSON files as the trainer wrote them (local controller)",
    "skyspot.trainer.data": "which data sources a run can read, checked by preflight before anything is paid for",
    "skyspot.trainer.interval": "initial_plan: the interval the trainer starts with, which the plan's egress counts",
    "skyspot.trainer.metrics.spot": "the node's price table (SKYSPOT_PRICES), which the task and the local executor fill",
    "skyspot.trainer.nccl_env": "the node's fabric table (SKYSPOT_FABRIC_ENV), which the task fills per instance type",
    "skyspot.trainer.metrics.hosts": "where the dashboards' credentials may go: checked at launch and on the node",
    "skyspot.trainer.parent_death": "die with the parent (prctl), which the local controller gives its nodes' shells",
    "skyspot.trainer.handover": "the handover object a make-before-break stage's nodes wait for, which the deadline's controller writes",
}

# Leaves: both sides import them, so they import (almost) nothing of skyspot themselves.
# skyspot.clouds is a package: its modules import each other and the errors, nothing else of skyspot.
LEAVES = {
    "skyspot.clouds": {"skyspot.errors"},
    "skyspot.ports": set(),
    "skyspot.str_enum": set(),
    "skyspot.statuses": {"skyspot.str_enum"},
    # the event and status types it reads, themselves leaves (events.py's one lazy import aside: the store)
    "skyspot.attempts": {"skyspot.clouds", "skyspot.events", "skyspot.statuses", "skyspot.str_enum"},
}


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
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                # `from skyspot import hub` names a module; `from skyspot.pricing.cost import run_cost` a function.
                found.add(
                    candidate
                    if (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(".py").exists()
                    or (PACKAGE.parent / candidate.replace(".", "/")).is_dir()
                    else base
                )
    return {name for name in found if name == "skyspot" or name.startswith("skyspot.")}


def _modules() -> dict[str, set[str]]:
    return {_module_name(path): _imports(path) for path in sorted(PACKAGE.rglob("*.py"))}


def _trainer_may_import(name: str) -> bool:
    """A contract the trainer may import, or a module of one (skyspot.clouds.aws, skyspot.storage.s3)."""
    return any(name == allowed or name.startswith(allowed + ".") for allowed in TRAINER_MAY_IMPORT)


def _in_trainer(name: str) -> bool:
    return name == "skyspot.trainer" or name.startswith("skyspot.trainer.")


def test_the_walk_sees_the_whole_package():
    modules = _modules()
    assert {"skyspot.trainer.loop", "skyspot.cli.main", "skyspot.clouds", "skyspot.attempts"} <= set(modules)
    assert "skyspot.hub" in modules["skyspot.trainer.base"]  # `from skyspot import hub`, inside a function


def test_the_trainer_imports_only_the_trainer_and_the_shared_contracts():
    wrong = {
        f"{module} imports {name}"
        for module, names in _modules().items()
        if _in_trainer(module)
        for name in names
        if not _in_trainer(name) and not _trainer_may_import(name) and name != "skyspot"
    }
    assert not wrong, "the trainer reaches into the CLI side:\n" + "\n".join(sorted(wrong))


def test_outside_the_trainer_only_its_public_contracts_are_imported():
    wrong = {
        f"{module} imports {name}"
        for module, names in _modules().items()
        if not _in_trainer(module)
        for name in names
        if _in_trainer(name) and name not in TRAINER_CONTRACTS
    }
    assert not wrong, "trainer internals imported from outside the trainer:\n" + "\n".join(sorted(wrong))


def _leaf_imports(modules: dict[str, set[str]], leaf: str) -> set[str]:
    """What the leaf (a module, or a package and its modules) imports from outside itself."""
    inside = [m for m in modules if m == leaf or m.startswith(leaf + ".")]
    return {name for m in inside for name in modules[m] if name != leaf and not name.startswith(leaf + ".")}


def test_cloud_facts_and_attempts_are_leaves():
    modules = _modules()
    for leaf, allowed in LEAVES.items():
        found = _leaf_imports(modules, leaf)
        assert found <= allowed, f"{leaf} imports {sorted(found - allowed)}"
    planted = {**modules, "skyspot.clouds.oracle": {"skyspot.clouds.base", "skyspot.pricing.prices"}}
    assert _leaf_imports(planted, "skyspot.clouds") == {"skyspot.errors", "skyspot.pricing.prices"}


def test_the_rule_catches_a_trainer_module_importing_the_cli(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from skyspot.cli.common import err\n")
    assert "skyspot.cli.common" in _imports(bad) - set(TRAINER_MAY_IMPORT)


def test_nothing_below_the_cli_imports_the_cli():
    """The CLI is the thin shell on top: executors, runs, cost and the rest print through
    skyspot.console and raise skyspot.errors; none of them reaches back up into skyspot.cli."""
    wrong = {
        f"{module} imports {name}"
        for module, names in _modules().items()
        if not module.startswith("skyspot.cli")
        for name in names
        if name.startswith("skyspot.cli")
    }
    assert not wrong, "the arrows run upward:\n" + "\n".join(sorted(wrong))


# --------------------------------------------------------------------------- the layers (issue 24)
# The package's floors, top to bottom: a module imports its own floor and the floors below it, never
# one above (docs/architecture.md, "Package layout"). The CLI is the shell; app/ holds the use-cases and
# is the only place that picks an executor; the trainer and node_env run on the nodes and import only
# the contracts (and the trainer's public contracts are all the rest may import of it, above).
LAYERS = [
    ("cli", ("skyspot.cli",)),
    ("app", ("skyspot.app",)),
    ("executors", ("skyspot.executors",)),
    ("task", ("skyspot.task",)),
    ("planning", ("skyspot.planning",)),
    ("pricing", ("skyspot.pricing",)),
    ("node", ("skyspot.trainer", "skyspot.node_env")),
    (
        "contracts",
        (
            "skyspot.storage",
            "skyspot.recipe",
            "skyspot.recipe_keys",
            "skyspot.events",
            "skyspot.attempts",
            "skyspot.clouds",
            "skyspot.hub",
            "skyspot.sizing",
            "skyspot.start_bounds",
            "skyspot.lora",
            "skyspot.ledger",
            "skyspot.events_copy",
            "skyspot.errors",
            "skyspot.console",
            "skyspot.ports",
            "skyspot.deadline_text",
            "skyspot.yaml12",
            "skyspot.node_host",
            "skyspot.node_kinds",
            "skyspot.libpath",
            "skyspot.wheelhouse",
            "skyspot.statuses",
            "skyspot.str_enum",
            "skyspot",
        ),
    ),
]

# Arrows that point up, each with why; none may be added without one.
UPWARD: dict[tuple[str, str], str] = {}


def _layer(module: str) -> int:
    """The floor of `module` (0 is the top), by its longest listed prefix; a module no floor names fails."""
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    assert best is not None, f"{module} is on no floor: add it to LAYERS in tests/test_imports.py"
    return best[0]


def _upward(modules: dict[str, set[str]]) -> set[str]:
    return {
        f"{module} ({LAYERS[_layer(module)][0]}) imports {name} ({LAYERS[_layer(name)][0]})"
        for module, names in modules.items()
        for name in names
        if _layer(name) < _layer(module) and (module, name) not in UPWARD
    }


def test_every_module_is_on_a_floor_and_no_import_points_up():
    wrong = _upward(_modules())
    assert not wrong, "imports that point up a floor:\n" + "\n".join(sorted(wrong))


def test_the_trainer_and_the_node_entry_import_only_the_contracts_below_them():
    contracts = len(LAYERS) - 1
    wrong = {
        f"{module} imports {name}"
        for module, names in _modules().items()
        if LAYERS[_layer(module)][0] == "node"
        for name in names
        if _layer(name) < contracts and not (_in_trainer(module) and _in_trainer(name))
    }
    assert not wrong, "\n".join(sorted(wrong))


def test_the_upward_exceptions_are_still_needed():
    modules = _modules()
    gone = {f"{a} -> {b}" for a, b in UPWARD if b not in modules.get(a, set())}
    assert not gone, "an exception no import needs any more (drop it from UPWARD):\n" + "\n".join(sorted(gone))


def test_a_planted_upward_import_fails_the_layer_rule(tmp_path):
    """The circle issue 24 broke (cost -> executors.sky -> launch -> ...) cannot come back: cost importing an
    executor again, or an executor importing the launch use-case, is an arrow up a floor."""
    planted = tmp_path / "cost.py"
    planted.write_text("def where(record):\n    from skyspot.executors.sky.sdk import where_from_queue\n")
    planted_app = tmp_path / "sdk.py"
    planted_app.write_text("from skyspot.app.launch import launch\n")
    modules = {
        **_modules(),
        "skyspot.pricing.cost": _imports(planted),
        "skyspot.executors.sky.sdk": _imports(planted_app),
    }
    wrong = _upward(modules)
    assert "skyspot.pricing.cost (pricing) imports skyspot.executors.sky.sdk (executors)" in wrong
    assert "skyspot.executors.sky.sdk (executors) imports skyspot.app.launch (app)" in wrong
    assert not _upward(_modules())


def test_the_package_root_holds_only_the_contracts_and_the_node_entry():
    root = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    allowed = {name.rpartition(".")[2] for _, prefixes in LAYERS[-2:] for name in prefixes if name.count(".") == 1}
    assert root <= allowed, f"modules at the root that belong on a floor: {sorted(root - allowed)}"


def _circles(modules: dict[str, set[str]]) -> list[list[str]]:
    """The import graph's circles: its strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for name in modules.get(module, ()):
            if name not in modules or name == module:
                continue
            if name not in index:
                visit(name)
                low[module] = min(low[module], low[name])
            elif name in stack:
                low[module] = min(low[module], index[name])
        if low[module] == index[module]:
            component = []
            while True:
                name = stack.pop()
                component.append(name)
                if name == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(modules):
        if module not in index:
            visit(module)
    return found


def test_the_import_graph_has_no_circle_within_a_floor_either():
    circles = _circles({m: names - {"skyspot"} for m, names in _modules().items()})
    assert not circles, "modules that import each other (round, lazily or not):\n" + "\n".join(map(str, circles))
    planted = {
        "skyspot.executors.sky.sdk": {"skyspot.executors.sky.submit"},
        "skyspot.executors.sky.submit": {"skyspot.executors.sky.sdk"},
    }
    assert _circles(planted) == [["skyspot.executors.sky.sdk", "skyspot.executors.sky.submit"]]


# --------------------------------------------------------------------------- the shell (issue 33)
# The CLI parses flags, makes one call into app/ and prints: it imports app/ (the use-cases), the console
# it prints through, the errors it turns into exit codes, itself, and the package root (its version).
CLI_MAY_IMPORT = ("skyspot.app", "skyspot.console", "skyspot.errors", "skyspot.cli")


def _cli_reaches_past_app(modules: dict[str, set[str]]) -> set[str]:
    return {
        f"{module} imports {name}"
        for module, names in modules.items()
        if module.startswith("skyspot.cli")
        for name in names
        if name != "skyspot"
        and not any(name == allowed or name.startswith(allowed + ".") for allowed in CLI_MAY_IMPORT)
    }


def test_the_cli_imports_only_the_use_cases_the_console_and_the_errors():
    wrong = _cli_reaches_past_app(_modules())
    assert not wrong, "the CLI reaches past app/:\n" + "\n".join(sorted(wrong))


def test_a_planted_cli_import_of_an_executor_fails_the_shell_rule(tmp_path):
    for planted_import in (
        "from skyspot.executors import executor_for",
        "from skyspot.task import package",
        "from skyspot.planning.deadline import when",
        "import skyspot.pricing.prices",
        "from skyspot.ledger import Ledger",
    ):
        planted = tmp_path / "launch.py"
        planted.write_text(f"def f():\n    {planted_import}\n")
        wrong = _cli_reaches_past_app({**_modules(), "skyspot.cli.launch": _imports(planted)})
        assert any(line.startswith("skyspot.cli.launch imports ") for line in wrong), planted_import
