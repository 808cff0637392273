"""Import DeepSpeed without the parts of it the trainer never runs, so every rank starts sooner.

Every start of every rank imports DeepSpeed (a first start, a new attempt, and each restart in place,
when the whole node waits for the slowest rank). Two of its imports do no work for skyspot and cost
more than a second of CPU each (`python -X importtime`, torch 2.13.0 CPU, deepspeed 0.19.8, Python
3.11; figures in docs/benchmarks.md, section 15):

- `import deepspeed` imports its autotuner (deepspeed/autotuning/autotuner.py: `try: import mlflow`),
  which loads mlflow wherever it is installed, as it is on the node of a recipe with an mlflow
  dashboard: 1.75 s. Only the autotuner reads `has_mlflow`; skyspot never runs it. mlflow is hidden
  while DeepSpeed imports and is importable as ever afterwards (rank 0's dashboard imports it).
- ZeRO's optimizer setup imports the Muon optimizer for one `isinstance` check (stage3.py: "importing
  Muon compiles its kernels, which slows down import deepspeed"); its module decorates three
  functions with `torch.compile`, which imports TorchInductor at decoration: 1.7 s. Imported here
  with DeepSpeed's `compiler.compile` returning a decorator that compiles on the first call instead,
  so the module, its classes and its functions are all there, and Muon, if a recipe ever used it,
  would compile exactly what it compiles now, at its first step.

Written here because neither library offers a switch: DeepSpeed reads no setting before these imports,
and `torch.compile` resolves its backend (TorchInductor) at decoration, whatever TORCH_COMPILE_DISABLE says.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable, Iterator

MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"  # imports original_muon, the compiled one


@contextlib.contextmanager
def _hidden(name: str) -> Iterator[None]:
    """`import name` fails inside (ImportError, as if it were not installed), unless already imported."""
    if name in sys.modules:
        yield
        return
    sys.modules[name] = None  # type: ignore[assignment]  # the import system's "not importable" entry
    try:
        yield
    finally:
        if name in sys.modules and sys.modules[name] is None:
            del sys.modules[name]


def compile_on_first_call() -> Callable[[Callable], Callable]:
    """A stand-in for `torch.compile` as a bare decorator: the function is compiled when first called."""

    def decorate(fn: Callable) -> Callable:
        compiled: Any = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal compiled
            import torch

            if torch.compiler.is_compiling():
                return fn(*args, **kwargs)  # traced into by a caller's compile: no compile of its own
            if compiled is None:
                compiled = torch.compile(fn)
            return compiled(*args, **kwargs)

        # As torch.compile's own wrapper: a caller being compiled inlines `fn`, not this wrapper (whose
        # `compiled` would otherwise be set to the plain `fn` by the trace; torch/_dynamo/eval_frame.py).
        call._torchdynamo_inline = fn  # type: ignore[attr-defined]
        return call

    return decorate


def import_deepspeed():
    """`import deepspeed`, less mlflow and TorchInductor (module docstring); returns the module."""
    with _hidden("mlflow"):
        import deepspeed
    if MUON_MODULE not in sys.modules:
        from deepspeed.runtime import compiler

        eager = compiler.compile
        compiler.compile = compile_on_first_call  # read by the Muon module's decorators, at its import
        try:
            __import__(MUON_MODULE)
        except Exception:  # noqa: BLE001 - as DeepSpeed's own lazy import would fail later, it fails there
            pass
        finally:
            compiler.compile = eager
    return deepspeed
