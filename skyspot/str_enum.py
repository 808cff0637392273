"""A string enum that works on every Python skyspot runs on.

`enum.StrEnum` arrived in Python 3.11, but the package supports 3.10 (pyproject's `requires-python`)
and the trainer runs in the node's own interpreter: Python 3.10 on SkyPilot's default Ubuntu 22.04
images (sky/skylet/constants.py, the user venv), older in some custom images. So skyspot's contracts
use this base, a `str` mixin that behaves as StrEnum does where it matters: a member *is* its string
(equal to it, same hash, so dict and set lookups with plain strings work), `str()` and f-strings give
the value, and `json.dumps` writes the bare string, so files written with members read as before.
"""

from __future__ import annotations

from enum import Enum
from typing import Optional, Type, TypeVar

E = TypeVar("E", bound="StrEnum")


class StrEnum(str, Enum):
    """A str-valued Enum: members compare equal to, hash as, and print as their values."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:  # Python < 3.12 would format the member's name in some mixins
        return format(str(self.value), spec)

    @classmethod
    def parse(cls: Type[E], value: object) -> Optional[E]:
        """The member whose value is `value` (a member, or its string), or None for anything else."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls._value2member_map_.get(value)  # type: ignore[return-value]
        return None
