#!/usr/bin/env bash
# Create .venv and install hvdplus with PyTorch (CPU), TensorFlow (CPU), mpi4py and the Open MPI wheel (no compiler, no system MPI), and matplotlib for the benchmark plots.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# setuptools new enough for an SPDX license string: the alias tests build a wheel of this checkout without isolation.
.venv/bin/python -m pip install -q --upgrade pip "setuptools>=77"
# torch first, pinned, so pip takes the CPU build instead of resolving a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==${HVDPLUS_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[torch,tensorflow,mpi,dev,examples,bench]"
echo "hvdplus installed in $(pwd)/.venv"
