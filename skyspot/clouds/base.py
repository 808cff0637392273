"""What a cloud must provide, and the registry of the clouds that do.

SkyPilot keeps everything about a cloud in one registered class (sky/clouds/cloud.py `Cloud`, with
sky/clouds/aws.py, gcp.py, azure.py registered by `@registry.CLOUD_REGISTRY.type_register`); so does
skyspot: a cloud is one subclass of `Cloud` in one module of this package, and `register` refuses a
class that leaves any part of `REQUIRED` out, so a fourth cloud is one file plus its tests, not edits in
seven modules. Everything else asks `get(name)` or `all()` and never branches on a cloud's name.

Standard library only, beside skyspot.errors: the trainer on every node and the CLI at start-up both
read it.
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass
from typing import ClassVar, Mapping, Optional

from skyspot.errors import UsageError


class CloudDefinitionError(TypeError):
    """A cloud class that leaves out a part every cloud must provide (a programming error, not usage)."""


@dataclass(frozen=True)
class SimulatedPlace:
    """Where the local executor's simulated node of a cloud "is" (docs/local.md): a region and zone of
    the cloud's own, a stand-in 8-GPU instance type the cost report prices a CPU recipe's run as, and
    the shortest period a scaled-down notice window may poll at."""

    region: str
    zone: Optional[str]
    stand_in: str
    min_poll_s: float


class Cloud(abc.ABC):
    """One cloud's facts and rules. A subclass sets every attribute named in `REQUIRED` and implements
    every abstract method; the defaults below are the rule most clouds follow, overridden where one
    does not."""

    # -- identity
    name: ClassVar[str]
    """The lower-case name recipes, events and the ledger use: "aws"."""
    label: ClassVar[str]
    """How people (and SkyPilot's SKYPILOT_CLUSTER_INFO, its `repr`) spell it: "AWS"."""

    # -- preemption notices (the trainer's watcher, the CLI's window check, the local executor)
    notice_window_s: ClassVar[float]
    """Seconds between a spot preemption notice and the VM going away."""
    notice_poll_s: ClassVar[float]
    """How often the watcher asks the metadata service (for a hanging GET: its retry period)."""
    notice_detect_s: ClassVar[float]
    """How late the trainer can learn of a notice: the polling period, 0 for a hanging GET."""
    notice_watcher: ClassVar[str]
    """The node-side module that speaks this cloud's metadata protocol (skyspot/trainer/notice/NAME.py):
    `bind(watcher)` for its notices, `read_instance(http, environ, left)` for what the node is (instance
    type, capacity, zone, image; trainer/instance.py). Named, not imported, so this contract never imports
    the trainer."""
    sigterm: ClassVar[Optional[str]]
    """When the OS gets SIGTERM on a spot preemption: "at_deadline" (the notice's time), "with_notice",
    or None (no signal; the VM is evicted at the deadline)."""
    planned_actions: ClassVar[frozenset[str]]
    """The watcher's `action` words that are a planned shutdown (maintenance), not a spot preemption."""

    # -- the metadata service (node side)
    metadata_endpoint_var: ClassVar[str]
    """The variable that redirects the metadata endpoint (the one the cloud's SDKs read, where they have one)."""
    metadata_default_endpoint: ClassVar[str]
    """The metadata service's address on a real VM."""

    # -- the local executor's stand-in for this cloud
    simulated: ClassVar[SimulatedPlace]
    """Where its simulated node is, and how fast a scaled notice window may poll (executors/local)."""

    # -- where a run's data lives
    store_scheme: ClassVar[str]
    """The store URI scheme of this cloud's object store (skyspot.storage parses the URI)."""
    region_pattern: ClassVar[re.Pattern[str]]
    """How this cloud spells a region name (candidates map a region to its cloud by it)."""

    # -- published spot signals (planning/spot_signals.py)
    spot_signal: ClassVar[Optional[str]]
    """The published per-type spot interruption signal skyspot ships for this cloud (the feed's name), or None."""
    spot_signal_missing: ClassVar[str]
    """Without one, why not (shown beside the prior in `spot-risk` and the dry run's risk lines)."""

    # -- the fast fabric SkyPilot gives `network_tier: best`
    fabric: ClassVar[Optional[str]]
    """The fabric's name, or None where SkyPilot has none on this cloud."""
    fabric_accelerators: ClassVar[tuple[str, ...]]
    """The accelerator specs the fabric is for; () for every one."""
    no_fabric: ClassVar[str]
    """Why a candidate goes without it (the plan's note)."""

    # -- bandwidth and preemption priors (the window check, the trainer's first interval plan)
    upload_gbps: ClassVar[float]
    """Assumed sustained upload of one node to a same-region store, GB/s."""
    prior_node_hours: ClassVar[Mapping[str, float]]
    """Prior mean time between preemptions of one spot node, hours, by accelerator class
    ("large", "small", "cpu")."""

    # -- prices (pricing/prices.py reads the snapshot and SkyPilot's catalog with these)
    attached_gpus: ClassVar[tuple[tuple[re.Pattern[str], str, Optional[int]], ...]]
    """Where the catalog prices a machine's GPUs in rows of their own beside its VM row (GCP): (instance
    type pattern, accelerator, count or None for the pattern's group 1) per machine family; () elsewhere."""
    spot_at_on_demand_is_spot: ClassVar[bool]
    """A spot price equal to the on-demand one is a real spot price (False: it is the on-demand price again)."""
    count_fixes: ClassVar[Mapping[str, int]]
    """Instance type (lower case) -> the true accelerator count where the catalog's is wrong."""

    @abc.abstractmethod
    def root_disk_write(self, disk_size_gb: int) -> tuple[float, str]:
        """(GB/s, why) for a write to the root disk SkyPilot gives a node with `disk_size` = `disk_size_gb`."""

    @abc.abstractmethod
    def native_action(self, action: str) -> Optional[str]:
        """The cloud's own word for a watcher's `action` (what its docs and consoles say), or None."""

    @abc.abstractmethod
    def metadata_redirect_env(self, url: str) -> dict[str, str]:
        """Every variable that points this cloud's watcher, and the cloud's SDKs on a node, at the
        metadata server at `url` ('http://host:port'): the first is the watcher's (metadata_endpoint_var),
        the rest what the SDKs read, so nothing on a node under test reaches for a real metadata address."""

    @abc.abstractmethod
    def fabric_env(self, instance_type: Optional[str]) -> dict[str, str]:
        """The variables NCCL needs on a fabric node of `instance_type` (the cloud's own docs or SkyPilot's
        example, cited where set); {} where it has no fabric. Rendered per instance type into the task
        (task/render.py `fabric_envs`) and exported on the node that is one (trainer/nccl_env.py).
        `SKYSPOT_LIBPATH_PREPEND` names folders to put first on LD_LIBRARY_PATH and keep there."""

    @abc.abstractmethod
    def fabric_image(self, instance_type: Optional[str]) -> Optional[str]:
        """The image a fabric node of `instance_type` must boot for its fabric's user space (a candidate's
        `image_id`), or None to leave SkyPilot's choice."""

    # -- rules most clouds share; a cloud overrides what it does differently

    def metadata_override(self, env: Mapping[str, str]) -> str:
        """The endpoint override set in `env`, '' when none."""
        return env.get(self.metadata_endpoint_var, "").strip()

    def metadata_endpoint(self, env: Mapping[str, str]) -> Optional[str]:
        """The endpoint a real VM uses when nothing redirects it; None: the user turned metadata off."""
        return self.metadata_default_endpoint

    def metadata_fallback(self, env: Mapping[str, str]) -> Optional[str]:
        """An address to use when the endpoint's host name does not resolve; None for most clouds."""
        return None

    def opt_in_zone(self, zone: Optional[str]) -> bool:
        """True for a zone an account must opt into before it can run there."""
        return False

    def image_fabric(self, instance_type: Optional[str]) -> Optional[str]:
        """The fabric a node of `instance_type` gets from its image and NCCL's settings alone (`fabric_image`,
        `fabric_env`), without `network_tier`, for the plan's note; None for most clouds (Azure ND: InfiniBand)."""
        return None

    def fast_fabric(self, accelerators: Optional[str]) -> tuple[Optional[str], str]:
        """(the fabric `network_tier: best` gets a candidate of `accelerators`, or None; why not, when None)."""
        if self.fabric is None:
            return None, self.no_fabric
        if not accelerators:
            return None, "CPU nodes: no fast fabric"
        if self.fabric_accelerators and accelerators not in self.fabric_accelerators:
            return None, self.no_fabric
        return self.fabric, ""


def endpoint_url(value: str) -> str:
    """A metadata endpoint as a URL: GCE_METADATA_HOST and GCE_METADATA_IP are host[:port], by Google's convention."""
    if "://" not in value:
        value = "http://" + value
    return value.rstrip("/")


REQUIRED: tuple[str, ...] = tuple(name for name in Cloud.__annotations__) + tuple(sorted(Cloud.__abstractmethods__))
"""Every part a cloud class must provide: the attributes declared on `Cloud` and its abstract methods."""

_REGISTRY: dict[str, Cloud] = {}


def missing_parts(cls: type) -> list[str]:
    """The parts of REQUIRED that `cls` leaves out (an attribute never set, an abstract method)."""
    missing = [name for name in Cloud.__annotations__ if not hasattr(cls, name)]
    return missing + sorted(getattr(cls, "__abstractmethods__", ()))


def register(cls: type[Cloud]) -> type[Cloud]:
    """Class decorator: check that `cls` provides every part of REQUIRED, then make it `get(cls.name)`."""
    if not (isinstance(cls, type) and issubclass(cls, Cloud)):
        raise CloudDefinitionError(f"{cls!r} is not a subclass of skyspot.clouds.Cloud")
    missing = missing_parts(cls)
    if missing:
        raise CloudDefinitionError(
            f"cloud class {cls.__name__} lacks {', '.join(missing)} (skyspot.clouds.base.REQUIRED)"
        )
    if cls.name != cls.name.lower() or not cls.name.isidentifier():
        raise CloudDefinitionError(f"cloud class {cls.__name__}: name {cls.name!r} must be a lower-case identifier")
    known = _REGISTRY.get(cls.name)
    if known is not None and type(known) is not cls:
        raise CloudDefinitionError(f"cloud '{cls.name}' is registered twice ({type(known).__name__}, {cls.__name__})")
    _REGISTRY[cls.name] = cls()
    return cls


def names() -> tuple[str, ...]:
    """The registered clouds' names, in registration order ("aws", "gcp", "azure")."""
    return tuple(_REGISTRY)


def all() -> tuple[Cloud, ...]:  # noqa: A001 - `clouds.all()`, as the registry reads
    """Every registered cloud, in registration order."""
    return tuple(_REGISTRY.values())


def _expected() -> str:
    known = names()
    return ", ".join(known[:-1]) + f" or {known[-1]}" if len(known) > 1 else "".join(known)


def get(name: Optional[str]) -> Cloud:
    """The registered cloud `name` (any case); a one-line UsageError naming the known ones otherwise."""
    cloud = _REGISTRY.get(str(name or "").strip().lower())
    if cloud is None:
        raise UsageError(f"unknown cloud '{name}'; expected {_expected()}")
    return cloud


def find(name: Optional[str]) -> Optional[Cloud]:
    """The registered cloud `name` (any case), or None: for readers of what a node or an event says."""
    return _REGISTRY.get(str(name or "").strip().lower()) if isinstance(name, str) else None


__all__ = [
    "Cloud",
    "CloudDefinitionError",
    "SimulatedPlace",
    "REQUIRED",
    "register",
    "missing_parts",
    "names",
    "all",
    "get",
    "find",
    "endpoint_url",
]
