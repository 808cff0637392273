#!/usr/bin/env bash
# The GPU check on one GPU machine (docs/benchmarks.md, "GPU check"): install the node environment the
# way a node's setup does, then `python -m bench --gpu` (bench/gpu.py). At most 8 minutes on one H200;
# needs no network.
#
#   scripts/gpu_check.sh [OUT_DIR]      # figures: OUT_DIR/gpu_check.json, gpu_check.md, gpu_check.*.log
#                                       # (default: $OUT when set, else ./gpu-check in the repository)
#
# Wheels: when the repository carries a .whl/ folder, it is the only package source (pip --no-index
# --find-links .whl) and every wheel in it is installed first; without it, torch, DeepSpeed and the rest
# of the stack must already be installed for python3 ($PYTHON). Either way nothing reaches an index.
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
# The node's venv as SkyPilot makes it (sky/skylet/constants.py): the image's interpreter, its packages visible.
rm -rf "$VENV"
if command -v uv >/dev/null 2>&1; then
  uv venv -q --seed --system-site-packages --python "$PY" "$VENV"
else
  "$PY" -m venv --system-site-packages "$VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install --quiet --disable-pip-version-check --no-index)
if [ -d "$REPO/.whl" ]; then
  PIP+=(--find-links "$REPO/.whl")
  say "installing the stack from .whl/ ($(ls "$REPO/.whl" | wc -l) wheels)"
  "${PIP[@]}" "$REPO"/.whl/*.whl
fi

# skyspot's node wheel, built as `launch` builds it (skyspot/task/package.py: the stack pinned to what is
# installed), and installed as setup installs it: every requirement must be satisfied with no index.
WHEEL="$(cd "$REPO" && PYTHONPATH="$REPO" "$VPY" -c \
  'import pathlib, tempfile; from skyspot.task.package import build; print(build(pathlib.Path(tempfile.mkdtemp())).wheel)')"
say "installing $(basename "$WHEEL")"
"${PIP[@]}" "$WHEEL"
# setup's own step, from the installed wheel (not the checkout): the CUDA check, DeepSpeed's ops built.
(cd "${TMPDIR:-/tmp}" && SKYPILOT_SETUP_NUM_GPUS_PER_NODE="${SKYPILOT_SETUP_NUM_GPUS_PER_NODE:-1}" \
  "$VPY" -m skyspot.trainer.prepare) >&2
say "installed in $(( $(date +%s) - started )) s"

left=$(( BUDGET_S - ($(date +%s) - started) ))
cd "$REPO"
SKYSPOT_GPU_CHECK_SECONDS="$left" timeout --signal=TERM "$(( left + 30 ))" \
  "$VPY" -m bench --gpu --out "$OUT_DIR"
