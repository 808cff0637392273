"""LD_LIBRARY_PATH without CUDA and NCCL: torch's wheels load their own.

    python -m skyspot.libpath        # prints $LD_LIBRARY_PATH filtered (setup and `run` export it)

torch's Linux wheels find their CUDA runtime, cuBLAS, cuDNN, nvJitLink and NCCL by RUNPATH (into the
`nvidia-*` wheels beside them), and `LD_LIBRARY_PATH` is searched before RUNPATH (ld.so(8)): a
directory on it holding another CUDA or NCCL overrides torch's own. Images put theirs there:
SkyPilot's CUDA image recipe writes /usr/local/cuda/lib64 into /etc/environment (CUDA 12.4 under a
`+cu126` torch: the `undefined symbol ... nvJitLink` failure), the AWS DLAMI its CUDA and NCCL, and
GCP's TCPX container /usr/local/nvidia/lib64:/usr/local/tcpx/lib64, the latter with the plugin
installer's own libnccl.so.2 (examples/gcp_gpu_direct_tcpx/nccl_tcpx_gcpvm_h100.yaml in SkyPilot).

A directory is dropped when it holds a CUDA toolkit or NCCL library, or its path names one
(`cuda`, `nccl`, `cudnn`). The driver's own libraries (libcuda.so.1, libnvidia-*) are not CUDA
toolkit libraries: a directory holding only those stays (the TCPX container's
/usr/local/nvidia/lib64 is the host's driver). A fabric plugin's directory the cloud needs goes
through `SKYSPOT_LIBPATH_KEEP` (':'-separated), e.g. the TCPX shim setup makes, which links the
plugin's files but not the installer's libnccl.so.2 (task/render.py).

Standard library only, Python 3.8 on: the task's setup runs it before skyspot is installed.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Iterable, Mapping, Optional

KEEP_ENV = "SKYSPOT_LIBPATH_KEEP"

# The CUDA toolkit's and NCCL's shared libraries (not the driver's: libcuda, libnvidia-*, libnvcuvid).
_TOOLKIT_LIB = re.compile(
    r"^lib(nccl|cudart|cublas(Lt)?|cudnn[a-z_]*|nvJitLink|nvrtc|cufft|curand|cusolver|"
    r"cusparse(Lt)?|nvToolsExt|cupti|nvshmem[a-z_]*)\.so(\.|$)"
)
_TOOLKIT_DIR = re.compile(r"(^|[/_.-])(cuda|nccl|cudnn)([/_.0-9-]|$)", re.IGNORECASE)


def holds_cuda_or_nccl(folder: str) -> bool:
    """The folder's path names CUDA, NCCL or cuDNN, or it holds one of their libraries."""
    if _TOOLKIT_DIR.search(folder):
        return True
    try:
        return any(_TOOLKIT_LIB.match(name) for name in os.listdir(folder))
    except OSError:
        return False


def clean(value: Optional[str], keep: Iterable[str] = ()) -> str:
    """`value` (an LD_LIBRARY_PATH) without the folders that hold CUDA or NCCL, but those in `keep`."""
    kept = {os.path.normpath(k) for k in keep if k}
    out = []
    for folder in (value or "").split(os.pathsep):
        if not folder or folder in out:
            continue
        if os.path.normpath(folder) in kept or not holds_cuda_or_nccl(folder):
            out.append(folder)
    return os.pathsep.join(out)


def clean_environ(environ: Mapping[str, str]) -> str:
    """The environment's LD_LIBRARY_PATH, cleaned, keeping what SKYSPOT_LIBPATH_KEEP names."""
    return clean(environ.get("LD_LIBRARY_PATH"), (environ.get(KEEP_ENV) or "").split(os.pathsep))


if __name__ == "__main__":
    sys.stdout.write(clean_environ(os.environ))
