"""Launch: recipe + overrides + flags -> a rendered task, ready for an executor.

`prepare(LaunchRequest) -> Prepared` makes every check a launch makes, once, for every kind of run (a dry
run, a local one, a cloud one) and picks the executor; `submit(prepared)` starts it. One function
(`build`) renders, so that `render`, `launch --dry-run`, `launch` and the local executor all see the same
recipe, the same candidates and the same YAML.

PACKAGE_MOUNT is where the nodes find the wheel (task/package.py), for the CLI's dry-run lines.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, Optional, Sequence

from pydantic import BaseModel

from skyspot.app.preflight import preflight
from skyspot.errors import UsageError
from skyspot.executors import Executor, launch_executor
from skyspot.ledger import check_new_run_name, check_run_name, new_run_name
from skyspot.app import rehearsal_record
from skyspot.planning.candidates import RESTART_SECONDS, Candidate, candidates, dropped, egress_basis
from skyspot.planning.notice_window import WindowReport, check_notice_windows
from skyspot.task import package as packaging
from skyspot.task.package import PACKAGE_MOUNT as PACKAGE_MOUNT  # re-exported: where the nodes find the wheel
from skyspot.task.package import Package
from skyspot.recipe import REGISTRY, Recipe, load_recipe, override_texts, parse_overrides, value_text
from skyspot.task.render import RECIPE_MOUNT, RenderedTask, render, to_yaml

# `resources` says where to run: the plan and SkyPilot have decided that before a node exists,
# and the trainer never reads it. Every other value set on top of the recipe file travels.
LAUNCH_ONLY_SECTIONS = ("resources",)


def _trainer_overrides(
    recipe: Recipe, overrides: Sequence[str], environ: Mapping[str, str], flags: Optional[Mapping[str, Any]]
) -> list[str]:
    """What the node's trainer gets on top of the recipe: every key the environment, the command
    line and the flags set here, once each, as `key=value` with the value this launch resolved
    (task/render.py sends them). Resolved, not replayed: the node applies its overrides in the order it
    gets them, and the launch applied them by precedence (flags > command line, in its order >
    environment), so a section override beside a key inside it (`'storage={store: A}' --store B`)
    would resolve to another value there. One value per key, at the outermost key where both a
    section and a key in it were set, cannot."""
    texts = override_texts(overrides, environ=environ, flags=flags)
    keys = [key for key in texts if key.split(".")[0] not in LAUNCH_ONLY_SECTIONS]
    # A key's own prefixes looked up in a set, not every other key compared with it: 20,000 overrides took
    # 400 million comparisons (issue 31, item 13).
    given = set(keys)
    outermost = [
        key
        for key in keys
        if not any(".".join(parts[:i]) in given for parts in (key.split("."),) for i in range(1, len(parts)))
    ]
    return [_resolved_text(recipe, key, texts[key]) for key in outermost]


def _resolved_text(recipe: Recipe, key: str, typed: str) -> str:
    """`key=value` with the recipe's validated value at `key`: the user's own text where it reads
    back to that value (the node then sees what the user typed), else the value written anew (a
    section beside a key in it, a relative path made absolute, `S3://` spelled `s3://`)."""
    node: Any = recipe
    for part in key.split("."):
        if isinstance(node, BaseModel) and part in type(node).model_fields:
            node = getattr(node, part)
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return typed
    value = node.model_dump() if isinstance(node, BaseModel) else node
    if not isinstance(node, BaseModel) and parse_overrides([typed])[0][1] == value:
        return typed
    return f"{key}={value_text(value)}"


def efa_regions(planned: Sequence[Any]) -> list[str]:
    """The regions an AWS candidate that gets EFA (SkyPilot's rule, clouds/aws.py) may land in: its own, or
    every region of the price snapshot offering its instance type (no opt-in zones); [] without one."""
    from skyspot.clouds.aws import AWS, gets_efa
    from skyspot.pricing import prices as pricing

    regions: set[str] = set()
    for c in planned:
        if gets_efa(c):
            if c.region:
                regions.add(c.region)
            else:
                regions.update(
                    r["region"]
                    for r in pricing.snapshot_rows(AWS.name)
                    if r["instance_type"] == c.instance_type and not r["opt_in_zone"]
                )
    return sorted(regions)


def resolve_efa_images(planned: Sequence[Any]) -> dict[str, str]:
    """Amazon's EFA AMI per region the plan's EFA candidates may use (clouds/aws_images.py); {} and no
    network when none does; UsageError (one line) when it cannot be resolved."""
    regions = efa_regions(planned)
    if not regions:
        return {}
    from skyspot.clouds import aws_images

    return aws_images.resolve(regions)


# What gives an EFA node all its interfaces: SkyPilot's own advice where it attaches one (sky/clouds/aws.py:815-838),
# and what `use_internal_ips` asks of the network (https://docs.skypilot.co/en/latest/reference/config.html
# #aws-use-internal-ips: private subnets reachable from where SkyPilot runs, through SSM or a jump host).
EFA_ALL_INTERFACES = (
    "add to ~/.sky/config.yaml `aws: {use_internal_ips: true, use_ssm: true}` (or "
    "`ssh_proxy_command: ssh -W %h:%p -i KEY USER@JUMP_HOST` instead of use_ssm); the nodes then get "
    "no public IP: their subnets need a NAT gateway (or VPC endpoints) for the image, PyPI and the "
    "store, and SSM or the jump host must reach them (aws.vpc_name names the VPC)"
)


def aws_use_internal_ips(environ: Optional[Mapping[str, str]] = None) -> bool:
    """`aws.use_internal_ips` as SkyPilot's user config says it (SKYPILOT_GLOBAL_CONFIG, else ~/.sky/config.yaml:
    sky/skypilot_config.py:116-121); a project's .sky.yaml or an API server's config may differ."""
    import yaml

    environ = os.environ if environ is None else environ
    path = Path(environ.get("SKYPILOT_GLOBAL_CONFIG") or "~/.sky/config.yaml").expanduser()
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return False
    aws = config.get("aws") if isinstance(config, dict) else None
    return isinstance(aws, dict) and aws.get("use_internal_ips") is True


def efa_notes(built: RenderedTask, environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """One line per AWS candidate that gets EFA: how many interfaces SkyPilot 0.14.1 attaches and what gives all."""
    from skyspot.clouds.aws import efa_interfaces, gets_efa

    internal = aws_use_internal_ips(environ)
    lines = []
    seen = set()
    for c in built.candidates:
        if not gets_efa(c):
            continue
        if c.instance_type in seen:
            continue
        seen.add(c.instance_type)
        attached, most = efa_interfaces(c.instance_type, internal)
        if most is None:
            lines.append(
                f"EFA on {c.instance_type}: SkyPilot asks AWS for its interfaces at launch; without "
                f"aws.use_internal_ips it attaches one. To attach all: {EFA_ALL_INTERFACES}"
            )
        elif attached < most:
            lines.append(
                f"EFA on {c.instance_type}: SkyPilot will attach {attached} of {most} EFA interfaces "
                f"(aws.use_internal_ips is not set). To attach all {most}: {EFA_ALL_INTERFACES}"
            )
        else:
            lines.append(
                f"EFA on {c.instance_type}: SkyPilot will attach all {most} EFA interface(s)"
                + (" (aws.use_internal_ips is set)" if most > 1 else "")
            )
    if lines:
        lines.append(
            "EFA image: launch resolves Amazon's own AMI per region and refuses the fabric where SkyPilot's "
            "name-only lookup would boot another (docs/clouds.md, 'The fabric')"
        )
    return lines


def add_efa_images(built: RenderedTask) -> RenderedTask:
    """The task with Amazon's EFA AMI per region its EFA candidates may use (SKYSPOT_EFA_IMAGES, which each
    EFA node checks in setup: trainer/nccl_env.py); unchanged without one; UsageError when unresolved."""
    images = resolve_efa_images(built.candidates)
    if images:
        from skyspot.clouds.aws_images import IMAGES_ENV

        built.task["envs"][IMAGES_ENV] = json.dumps(images, separators=(",", ":"))
        built.yaml = to_yaml(built.task, built.recipe)
    return built


def build(
    recipe_arg: str,
    overrides: Sequence[str] = (),
    *,
    flags: Optional[Mapping[str, Any]] = None,
    run_name: Optional[str] = None,
    environ: Optional[Mapping[str, str]] = None,
    local: bool = False,
    package: Optional[Package] = None,
    loaded: Optional[Recipe] = None,
    exclude: Collection[Candidate] = (),
) -> RenderedTask:
    """Load and render. A registry name travels to the node as is; a recipe file is mounted
    on cloud nodes (RECIPE_MOUNT) or, for the local executor (`local`), read where it is.
    `package` is the skyspot wheel the nodes install (package.build()). `loaded`: the recipe as
    load_recipe already gave it for these same arguments (the CLI loads it first, for its errors and
    its choices), so it is not loaded twice. `exclude`: planned candidates left out of the task (those whose
    rehearsal failed: app/rehearsal_record.py); leaving out every one is refused in one line."""
    environ = os.environ if environ is None else environ
    recipe = loaded if loaded is not None else load_recipe(recipe_arg, overrides, environ=environ, flags=flags)
    trainer_overrides = _trainer_overrides(recipe, overrides, environ, flags)
    from skyspot.planning.spot_risk import read_history

    history = read_history() if recipe.resources.spot else None  # this machine's preemptions (spot_risk.py)
    planned = [c for c in candidates(recipe, environ=environ, history=history) if c not in exclude]
    if not planned:
        raise UsageError(
            f"every candidate of '{recipe.name}' failed its last rehearsal: fix what it said and "
            "`--rehearse` again, or pass --force to keep them"
        )
    if recipe_arg in REGISTRY:
        node_arg, recipe_file = recipe_arg, None
    elif local:
        node_arg, recipe_file = str(Path(recipe_arg).resolve()), None
    else:
        node_arg, recipe_file = RECIPE_MOUNT, str(Path(recipe_arg).resolve())
    task = render(
        recipe,
        planned,
        recipe_arg=node_arg,
        recipe_file=recipe_file,
        overrides=trainer_overrides,
        run_name=run_name,
        package_dir=str(package.folder) if package else None,
        local=local,
    )
    if recipe.metrics.backends:  # the hosts the user's environment names travel beside their tokens
        from skyspot.trainer.metrics.hosts import node_envs

        task["envs"].update(node_envs(recipe.metrics.backends, environ))
    return RenderedTask(
        recipe=recipe,
        recipe_arg=recipe_arg,
        task=task,
        yaml=to_yaml(task, recipe),
        candidates=planned,
        trainer_overrides=trainer_overrides,
        run_name=run_name,
        package=package,
    )


def _where_text(c: Candidate) -> str:
    return (
        f"{c.cloud} {c.region or 'any'} {c.accelerators or 'CPU'} {c.instance_type or '-'} "
        f"{'spot' if c.spot else 'on-demand'}"
    )


def placement_notes(built: RenderedTask) -> list[str]:
    """The plan's placement in lines: the order's rule, each spot risk figure's source (once per distinct
    source), and, under expected_cost, each candidate whose place differs from its price order and why."""
    placement = built.recipe.resources.placement
    nodes = built.recipe.resources.num_nodes
    if placement == "price":
        lines = ["placement: by price (resources.placement=price): nodes + egress only; preemptions not counted"]
    else:
        lines = [
            f"placement: by expected cost per hour of training (resources.placement=expected_cost; "
            f"=price keeps the price order): nodes + egress + preemptions/node-h x {nodes} node(s) x the cost "
            f"of one (restart {RESTART_SECONDS / 60:.0f} min on every node + half a checkpoint interval)"
        ]
    seen: set[tuple[str, str]] = set()
    for c in built.candidates:
        if c.spot and c.risk_source and (_where_text(c), c.risk_source) not in seen:
            seen.add((_where_text(c), c.risk_source))
            lines.append(
                f"risk {_where_text(c)}: {c.preemptions_per_node_hour:.3f} preemptions/node-h: {c.risk_source}"
            )
    if placement != "expected_cost":
        return lines
    moved = [(i, c) for i, c in enumerate(built.candidates, 1) if c.price_rank is not None and c.price_rank != i]
    if not moved:
        lines.append("the expected-cost order is the price order here")
    for i, c in moved:
        overhead = (c.expected_cost_usd_per_hour or 0.0) - (c.expected_usd_per_hour or 0.0)
        lines.append(
            f"#{i} {_where_text(c)} is #{c.price_rank} by price: ${c.expected_usd_per_hour or 0:,.2f}/h "
            f"+ expected preemptions ${overhead:,.2f}/h ({c.preemptions_per_node_hour or 0:.3f}/node-h x "
            f"{nodes} x ${c.preemption_usd or 0:,.2f} each) = ${c.expected_cost_usd_per_hour or 0:,.2f}/h"
        )
    return lines


def recovery_note(recipe: Recipe, *, deadline: bool) -> str:
    """Where a cloud run's recovery after a spot preemption goes: SkyPilot's own, or the controller's relaunch."""
    burst = recipe.resources.burst_minutes
    if recipe.resources.supervise or deadline:
        return (
            f"recovery: supervised ({'the deadline' if deadline else 'resources.supervise'}): skyspot's controller "
            f"job (one small on-demand CPU VM) relaunches a preempted spot stage with its region behind every region "
            f"cheaper than its expected cost for {burst:g} min (resources.burst_minutes; docs/planning.md, "
            "'Recoveries on a cloud')"
        )
    return (
        "recovery: SkyPilot's own (EAGER_NEXT_REGION, which in SkyPilot 0.14.1 relaunches in price order, usually "
        "into the region just preempted: skypilot #10021); resources.supervise=true leaves that region when it "
        "pays (docs/planning.md, 'Recoveries on a cloud')"
    )


def check_hosts(recipe: Recipe, environ: Mapping[str, str]) -> None:
    """A dashboard's credential goes only to the host the user's environment names for it, over https or
    to loopback (trainer/metrics/hosts.py); a recipe naming another MLflow server is refused in one line."""
    if not recipe.metrics.backends:
        return
    from skyspot.trainer.metrics.hosts import HostError, check

    try:
        check(recipe.metrics.mlflow_tracking_uri, recipe.metrics.backends, environ)
    except HostError as error:
        raise UsageError(str(error)) from None


def check_store(recipe: Recipe, *, local: bool) -> Optional[str]:
    """The run's store, checked against where the run runs; what the ledger records, the task
    mounts and the trainer resolves (they all read `recipe.storage.store`, which load_recipe
    decided by its one precedence rule and storage/uri.py spelled once, a local path absolute).

    A cloud run refuses a store on this machine: its checkpoints would live on a VM that a
    preemption takes away, and no other node could resume from them."""
    from skyspot.errors import UsageError
    from skyspot.storage import parse_store_uri

    store = recipe.storage.store
    if store and not local and parse_store_uri(store).is_local:
        raise UsageError(
            f"storage.store {store} is a directory on this machine; a cloud run's checkpoints must "
            "outlive its VMs: give a bucket (--store s3://BUCKET/PREFIX, gs://..., az://...), or run "
            "with --local"
        )
    return store


def plan_deadline(
    recipe: Recipe, *, local: bool, provision_seconds: float = 0.0, now: Optional[float] = None
) -> Optional[dict[str, Any]]:
    """The launch's deadline (resources.deadline, or --deadline), or None: when it falls (a duration
    counts from now), the policy and the step-time hint. A deadline that even all on-demand cannot
    make is refused here, with the arithmetic, before anything is recorded or paid for."""
    import time

    from skyspot.planning import deadline as dl
    from skyspot.errors import UsageError

    text = recipe.resources.deadline
    if not text:
        return None
    now = time.time() if now is None else now
    try:
        at = dl.parse_deadline(text, now)
    except dl.DeadlineError as error:
        raise UsageError(str(error)) from None
    if at - now > dl.MAX_AHEAD_SECONDS:
        raise UsageError(
            f"deadline {dl.when(at)} is more than {dl.MAX_AHEAD_SECONDS / 86400:.0f} days away: give "
            "a nearer one, or launch without --deadline"
        )
    from skyspot.planning.step_prior import step_seconds_floor

    restart = provision_seconds + dl.LOCAL_START_PRIOR_SECONDS if local else dl.CLOUD_RESTART_PRIOR_SECONDS
    floor, floor_source = step_seconds_floor(recipe)
    hint = recipe.resources.step_seconds_hint
    if hint and floor and hint < floor:  # issue 31, item 12: a hint no hardware can meet checks nothing
        raise UsageError(
            f"resources.step_seconds_hint {hint:.6g}s is below the fastest a step of this recipe can "
            f"be ({floor:.3g}s: {floor_source}): give a measured step time, or none"
        )
    check = dl.feasibility(
        now=now,
        deadline=at,
        steps=recipe.train.steps,
        step_seconds_hint=recipe.resources.step_seconds_hint,
        restart_seconds=restart,
        step_seconds_floor=floor,
        floor_source=floor_source,
    )
    if not check.ok:
        raise UsageError(check.text)
    return {
        "at": at,
        "start": now,
        "given": text,
        "policy": recipe.resources.deadline_policy,
        "step_seconds_hint": recipe.resources.step_seconds_hint,
        "step_seconds_prior": floor or None,
        "check": check.text,
    }


@dataclass
class LaunchRequest:
    """What `skyspot launch` was asked, as the command line gave it: parsed, not yet checked."""

    recipe: str
    """A registry name or a recipe file."""
    overrides: Sequence[str] = ()
    """`key=value` overrides, in command-line order."""
    flags: Mapping[str, Any] = field(default_factory=dict)
    """Recipe keys set by dedicated flags (`--store` is storage.store); they win over the overrides."""
    name: Optional[str] = None
    """The run's name (None: the recipe's name and the time)."""
    local: Optional[bool] = None
    """--local / --cloud; None: the recipe's resources.local_only decides."""
    executor_flags: Mapping[str, Any] = field(default_factory=dict)
    """The executor's own flags, raw, by name (None: not given); the chosen executor builds its options from
    them and refuses the ones it does not take (executors.launch_executor)."""
    dry_run: bool = False
    """Check and plan everything, record and submit nothing."""
    confirmed: bool = False
    """-y/--yes: the launch's question is answered."""
    interactive: bool = False
    """The command can ask the question (a terminal is attached)."""
    force: bool = False
    """--force: keep the candidates whose last rehearsal failed (app/rehearsal_record.py)."""


@dataclass
class Prepared:
    """A launch checked and planned (prepare): what `submit` starts and what the CLI shows before it does."""

    request: LaunchRequest
    built: RenderedTask
    executor: Executor
    """The run's executor, with the launch's options."""
    deadline: Optional[dict[str, Any]]
    """plan_deadline's plan, or None without a deadline."""
    question: Optional[str]
    """The confirmation starting this costs (money), or None."""
    rehearsed: list[tuple[Candidate, rehearsal_record.Record]] = field(default_factory=list)
    """Each planned candidate whose last rehearsal failed, with it: left out of the task, or with
    `request.force` kept."""

    @property
    def recipe(self) -> Recipe:
        return self.built.recipe

    def dropped(self) -> list[tuple[str, str, str]]:
        """(cloud, accelerators, why) for each accelerator of the recipe that is no candidate."""
        return dropped(self.recipe)

    def egress_basis(self) -> Optional[str]:
        """How the plan's egress figures were made, or None when there are none."""
        return egress_basis(self.recipe)

    def placement_notes(self) -> list[str]:
        """How the candidates are ordered, each distinct risk figure's source, where and why the order
        differs from the price order (placement_notes), and, on a cloud, where a recovery goes."""
        notes = placement_notes(self.built)
        if not self.executor.runs_here:
            notes.append(recovery_note(self.recipe, deadline=self.deadline is not None))
        return notes

    def efa_notes(self) -> list[str]:
        """Per AWS EFA candidate, the interfaces SkyPilot attaches and what gives all of them (efa_notes)."""
        return efa_notes(self.built)

    def window_report(self) -> WindowReport:
        """Can an emergency checkpoint become durable within each cloud's notice window? (docs/planning.md)"""
        return check_notice_windows(self.recipe)


def prepare(request: LaunchRequest, *, environ: Optional[Mapping[str, str]] = None) -> Prepared:
    """Every check a launch makes, once, in the order a user meets them, for every kind of run, a dry run
    included: the name, the recipe (loaded once), the executor and its options, the store, the deadline,
    then the task rendered; a real launch also asks its executor and the preflight (the hub, the model and
    the data, from here, before anything is paid for: app/preflight.py), a dry run the preflight's checks
    that need no network. Raises UsageError (one line) for the first problem; nothing is recorded."""
    environ = os.environ if environ is None else environ
    if request.name is not None:
        check_run_name(request.name)
    recipe = load_recipe(request.recipe, request.overrides, environ=environ, flags=request.flags)
    local = recipe.resources.local_only if request.local is None else request.local
    executor = launch_executor("local" if local else "sky", request.executor_flags, recipe)
    if not (request.dry_run or executor.runs_here or request.confirmed or request.interactive):
        raise UsageError(
            f"launching '{recipe.name}' on the cloud needs confirmation: pass -y/--yes "
            "when not attached to a terminal (--dry-run shows the plan first)"
        )
    check_store(recipe, local=executor.runs_here)  # a cloud run's store is a bucket, a dry run's as a real launch's
    package = packaging.build() if executor.installs_package else None
    # A deadline that even all on-demand cannot make is refused here, before anything is paid for.
    deadline = plan_deadline(recipe, local=executor.runs_here, provision_seconds=executor.start_seconds)
    if request.dry_run:
        run_name = request.name
    else:
        run_name = check_new_run_name(request.name) if request.name is not None else new_run_name(recipe.name)
    build_plan = functools.partial(
        build,
        request.recipe,
        request.overrides,
        flags=request.flags,
        run_name=run_name,
        environ=environ,
        local=executor.runs_here,
        package=package,
        loaded=recipe,
    )
    built = build_plan()
    rehearsed = failed_rehearsals(built)
    if rehearsed and not request.force:  # the candidates a rehearsal proved broken are not paid for again
        built = build_plan(exclude=[candidate for candidate, _ in rehearsed])
        executor = _simulating_a_kept_candidate(
            executor, request, recipe, built, skipped={candidate.cloud for candidate, _ in rehearsed}
        )
    if not request.dry_run:
        executor.check(built)  # what this executor refuses (no enabled cloud, a missing secret), nothing recorded
        if not executor.runs_here:  # Amazon's EFA image, or the fabric refused (clouds/aws_images.py)
            add_efa_images(built)
    check_hosts(recipe, environ)
    preflight(recipe, local=executor.runs_here, environ=environ, network=not request.dry_run)
    question = None if request.dry_run else executor.launch_question(built)
    return Prepared(
        request=request, built=built, executor=executor, deadline=deadline, question=question, rehearsed=rehearsed
    )


def _simulating_a_kept_candidate(
    executor: Executor, request: LaunchRequest, recipe: Recipe, built: RenderedTask, *, skipped: Collection[str]
) -> Executor:
    """A local run, which simulates one cloud, stands for the first candidate a rehearsal left in, unless
    --simulate names its cloud (then a cloud whose every candidate failed is refused in one line)."""
    if not executor.simulated:
        return executor
    simulated = request.executor_flags.get("simulate")
    kept = [candidate.cloud for candidate in built.candidates]
    if simulated is None:
        return launch_executor("local", {**request.executor_flags, "simulate": kept[0]}, recipe)
    if simulated in skipped and simulated not in kept:
        raise UsageError(
            f"--simulate {simulated}: every {simulated} candidate failed its last rehearsal "
            "(`skyspot launch --dry-run` says why): simulate another cloud, or pass --force"
        )
    return executor


def failed_rehearsals(built: RenderedTask) -> list[tuple[Candidate, rehearsal_record.Record]]:
    """Each candidate of the task whose (cloud, image, accelerators) failed its last rehearsal, with that record."""
    failures = rehearsal_record.failed()
    if not failures:
        return []
    entries = built.task["resources"]["ordered"]
    found = []
    for candidate, entry in zip(built.candidates, entries):
        record = failures.get(rehearsal_record.key_of(candidate, entry))
        if record is not None:
            found.append((candidate, record))
    return found


def submit(prepared: Prepared, *, detach: bool) -> int:
    """Record and start a prepared run on its executor; returns the exit code to pass on (attached: the
    run's own)."""
    if prepared.request.dry_run:
        raise ValueError("a dry run is not submitted")
    return prepared.executor.submit(prepared.built, detach=detach, deadline=prepared.deadline)
