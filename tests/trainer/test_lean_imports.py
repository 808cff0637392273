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
from deepspeed.autotuning import autotuner  # mlflow was hidden from it (and from nothing else that imports then)
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam  # what ZeRO's isinstance check imports
from deepspeed.runtime.zero.muon import original_muon
import mlflow  # rank 0's dashboard imports it afterwards as ever
print(json.dumps({
    "skipped": skipped,
    "autotuner_has_mlflow": autotuner.has_mlflow,
    "muon_class": MuonWithAuxAdam.__mro__[1].__name__,
    "lazy": [getattr(getattr(original_muon, f), "_torchdynamo_orig_callable", None) is None
             and getattr(original_muon, f)._torchdynamo_inline is getattr(original_muon, f).__wrapped__
             for f in ("muon_update", "zeropower_via_newtonschulz5")],  # ours, not torch.compile's wrapper
    "mlflow": mlflow.__name__,
    "inductor_after": "torch._inductor.compile_fx" in sys.modules,
}))
"""


def _probe(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600)
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


MUON_TWICE = r"""
import json, sys, torch
if sys.argv[1] == "lean":
    from skyspot.trainer.lean_imports import import_deepspeed
    import_deepspeed()
else:
    import deepspeed  # DeepSpeed's own eager decorator
from deepspeed.runtime.zero.muon import original_muon
from torch._dynamo.utils import counters
g = torch.Generator().manual_seed(0)
grad, momentum = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
before = "torch._inductor.compile_fx" in sys.modules
outs = [original_muon.muon_update(grad.clone(), momentum.clone()) for _ in range(2)]
print(json.dumps({"before": before, "after": "torch._inductor.compile_fx" in sys.modules,
                  "graphs": counters["stats"]["unique_graphs"], "recompiles": sum(counters["recompiles"].values()),
                  "outs": [o.tolist() for o in outs]}))
"""


@pytest.mark.slow
def test_muon_compiles_at_its_first_call_as_deepspeeds_decorator_would():
    """TorchInductor compiles C++ here (about a minute each): the slow set. DeepSpeed calls `muon_update`,
    which calls the Newton-Schulz functions: the same graphs as DeepSpeed's eager decorator makes, no
    recompile at the second call, the same numbers."""
    lean, eager = (_probe(MUON_TWICE, mode) for mode in ("lean", "eager"))
    assert (lean["before"], lean["after"]) == (False, True)
    assert eager["before"] is True  # its import compiled (the cost lean_imports saves)
    assert lean["recompiles"] == eager["recompiles"] == 0
    assert lean["graphs"] == eager["graphs"]
    assert lean["outs"] == eager["outs"] and lean["outs"][0] == lean["outs"][1]
