"""Shared by the reliability tests: the length of the shared uninterrupted `reference` run
(tests/conftest.py), which every faulted run must equal bitwise, and the comparison."""

from __future__ import annotations

from tests.conftest import REFERENCE_STEPS as STEPS  # noqa: F401 - the shared `reference` fixture's length


def same_params(ours, theirs) -> list[str]:
    """Names of the tensors of final/model.safetensors that differ between two run dirs (empty: bitwise equal)."""
    import torch
    from safetensors.torch import load_file

    a, b = load_file(ours / "final" / "model.safetensors"), load_file(theirs / "final" / "model.safetensors")
    return sorted(set(a) ^ set(b)) + [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]
