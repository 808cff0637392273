"""A rank imports DeepSpeed without mlflow and TorchInductor (lean_imports.py), and loses nothing by it.

Each check runs in a fresh interpreter: what a module import pulls in is only visible in one where
nothing was imported yet.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = r"""
import json, sys
from skyspot.trainer.lean_imports import import_deepspeed
deepspeed = import_deepspeed()
skipped = {name: name in sys.modules for name in ("mlflow", "torch._inductor.compile_fx")}
from deepspeed.autotuning import autotuner  # mlflow was hidden from it, and from it only
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam  # what ZeRO's isinstance check imports
from deepspeed.runtime.zero.muon import original_muon
import mlflow  # rank 0's dashboard imports it afterwards as ever
print(json.dumps({
    "skipped": skipped,
    "autotuner_has_mlflow": autotuner.has_mlflow,
    "muon_class": MuonWithAuxAdam.__mro__[1].__name__,
    "lazy": [hasattr(getattr(original_muon, f), "__wrapped__") for f in ("muon_update", "zeropower_via_newtonschulz5")],
    "mlflow": mlflow.__name__,
    "inductor_after": "torch._inductor.compile_fx" in sys.modules,
}))
"""


def _probe(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_deepspeed_imports_without_mlflow_and_inductor_and_keeps_muon_and_mlflow():
    facts = _probe(PROBE)
    assert facts["skipped"] == {"mlflow": False, "torch._inductor.compile_fx": False}
    assert facts["autotuner_has_mlflow"] is False
    assert facts["muon_class"] == "MuonWithAuxAdam"  # the real one, from original_muon
    assert facts["lazy"] == [True, True]
    assert facts["mlflow"] == "mlflow"
    assert facts["inductor_after"] is False  # nothing above compiled


@pytest.mark.slow
def test_muon_compiles_at_its_first_call_and_computes_what_deepspeeds_decorator_would():
    """TorchInductor compiles C++ here (about 20 s): the slow set."""
    facts = _probe(
        r"""
import json, sys, torch
from skyspot.trainer.lean_imports import import_deepspeed
import_deepspeed()
from deepspeed.runtime.zero.muon import original_muon
f = original_muon.zeropower_via_newtonschulz5
G = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
before = "torch._inductor.compile_fx" in sys.modules
got = f(G, 5)
from torch._dynamo.utils import counters
print(json.dumps({"before": before, "after": "torch._inductor.compile_fx" in sys.modules,
                  "graphs": counters["stats"]["unique_graphs"],
                  "same": torch.equal(got, torch.compile(f.__wrapped__)(G, 5)),
                  "eager": (got.float() - f.__wrapped__(G, 5).float()).abs().max().item() < 0.1}))
"""
    )
    # what DeepSpeed's own eager `@torch.compile` would have made, bitwise; and near the uncompiled
    # function (bfloat16 throughout: fused and unfused arithmetic round differently)
    assert facts == {"before": False, "after": True, "graphs": 1, "same": True, "eager": True}
