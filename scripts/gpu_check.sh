#!/usr/bin/env bash
# The GPU check on one GPU machine (docs/benchmarks.md, "GPU check"): install the node environment the
# way a node's setup does, then `python -m bench --gpu` (bench/gpu.py). At most 8 minutes on one H200;
# needs no network.
#
#   scripts/gpu_check.sh [OUT_DIR]      # figures: OUT_DIR/gpu_check.json, gpu_check.md, gpu_check.*.log
#                                       # (default: $OUT when set, else ./gpu-check in the repository)
#
# Wheels: when the repository carries a .whl/ folder, it is the only package source (--no-index
# --find-links .whl, for the build venv and for node_env's uv and pip); it must hold the torch build the
# driver gets (node_env.py TORCH_LINES: PyPI's on >= 580.65.06, else +cu126). Without it, node_env
# installs from the index (SKYSPOT_TORCH_INDEX for a mirror of PyTorch's).
# Disk: about 45 GB free in $TMPDIR (/tmp): a checkpoint of the 1B model is 14 GB, and a save keeps the
# previous one until the new one commits.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${1:-${OUT:-$REPO/gpu-check}}"
PY="$(command -v "${PYTHON:-python3}")"
VENV="${SKYSPOT_CHECK_VENV:-${TMPDIR:-/tmp}/skyspot-gpu-check-venv}"
BUDGET_S="${SKYSPOT_GPU_CHECK_SECONDS:-480}"
started=$(date +%s)
mkdir -p "$OUT_DIR"
say() { echo "[gpu_check] $*" >&2; }

say "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"
# A build venv with the stack (the .whl/ folder's wheels, or the interpreter's own packages) to build
# skyspot's node wheel in, as `launch` builds it (skyspot/task/package.py: the stack pinned to what is
# installed there).
rm -rf "$VENV"
if command -v uv >/dev/null 2>&1; then
  uv venv -q --seed --system-site-packages --python "$PY" "$VENV"
else
  "$PY" -m venv --system-site-packages "$VENV"
fi
BPY="$VENV/bin/python"
if [ -d "$REPO/.whl" ]; then
  say "installing the stack from .whl/ ($(ls "$REPO/.whl" | wc -l) wheels) to build the node wheel"
  "$BPY" -m pip install --quiet --disable-pip-version-check --no-index --find-links "$REPO/.whl" "$REPO"/.whl/*.whl
  # node_env's uv and pip read these: the .whl/ folder is the node's only package source, as an index would be.
  export UV_NO_INDEX=1 UV_FIND_LINKS="$REPO/.whl" PIP_NO_INDEX=1 PIP_FIND_LINKS="$REPO/.whl" UV_OFFLINE=1
fi
WHEEL="$(cd "$REPO" && PYTHONPATH="$REPO" "$BPY" -c \
  'import pathlib, tempfile; from skyspot.task.package import build; print(build(pathlib.Path(tempfile.mkdtemp())).wheel)')"

# Then the node's setup exactly as the rendered task runs it (task/render.py setup_script): node_env from
# inside the wheel on the bootstrap interpreter, into skyspot's own venv (the driver picks the torch
# line), LD_LIBRARY_PATH cleaned, and `prepare`: the CUDA check, DeepSpeed's ops, the node's facts.
export SKYSPOT_VENV="${SKYSPOT_CHECK_NODE_VENV:-${TMPDIR:-/tmp}/skyspot-gpu-check-node-venv}"
rm -rf "$SKYSPOT_VENV"
say "setup: node_env on $("$PY" --version 2>&1) with $(basename "$WHEEL")"
(cd "${TMPDIR:-/tmp}" && PYTHONPATH="$WHEEL" "$PY" -m skyspot.node_env setup --wheel "$WHEEL") >&2
VPY="$SKYSPOT_VENV/bin/python"
LD_LIBRARY_PATH="$("$VPY" -m skyspot.libpath)"; export LD_LIBRARY_PATH
(cd "${TMPDIR:-/tmp}" && SKYPILOT_SETUP_NUM_GPUS_PER_NODE="${SKYPILOT_SETUP_NUM_GPUS_PER_NODE:-1}" \
  "$VPY" -m skyspot.trainer.prepare) >&2
say "installed in $(( $(date +%s) - started )) s"

left=$(( BUDGET_S - ($(date +%s) - started) ))
cd "$REPO"
SKYSPOT_GPU_CHECK_SECONDS="$left" timeout --signal=TERM "$(( left + 30 ))" \
  "$VPY" -m bench --gpu --out "$OUT_DIR"
