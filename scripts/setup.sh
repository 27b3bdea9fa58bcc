#!/usr/bin/env bash
# Create .venv and install hvdplus with PyTorch (CPU), TensorFlow (CPU), mpi4py and the Open MPI wheel (no compiler, no system MPI), and matplotlib for the benchmark plots.
# HVDPLUS_EXTRAS picks the extras (pyproject.toml's optional-dependencies), by default the ones below, which
# scripts/test.sh needs; scripts/demo.sh asks for torch,tensorflow,mpi,examples. The pinned torch goes first if named.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${HVDPLUS_EXTRAS:-torch,tensorflow,mpi,dev,examples,bench,ray,spark}
# pip, less one notice: a pip configuration with local extra indexes (as on this project's build machines) makes
# pip say, for every package such an index lacks, that its location "is ignored". Everything else pip says stays.
pip_install() {
  .venv/bin/python -m pip install "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# setuptools new enough for an SPDX license string: the alias tests build a wheel of this checkout without isolation.
pip_install -q --upgrade pip "setuptools>=77"
# torch first, pinned, so pip takes the CPU build instead of resolving a multi-GB CUDA build.
case ",$EXTRAS," in
  *,torch,* | *,all,*) pip_install -q "torch==${HVDPLUS_TORCH_VERSION:-2.13.0}" ;;
esac
# setuptools' notice that the editable install works through a meta path finder is information, not a warning.
PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Editable installation" \
  pip_install -q -e ".[$EXTRAS]"
echo "hvdplus installed in $(pwd)/.venv"
