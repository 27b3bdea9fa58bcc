#!/usr/bin/env bash
# The README's first command. Set up .venv (scripts/setup.sh, with only the extras the demo needs), then train a small
# CNN on scikit-learn's digits on 2 ranks with hvdplusrun, in PyTorch (examples/pytorch_train.py) and in Keras
# (examples/keras_train.py), train each again as 1 process with the same global batch, and compare
# (scripts/demo_summary.py). About 2 minutes on 2 cores, setup included.
# The tour of every collective: .venv/bin/hvdplusrun -np 2 .venv/bin/python examples/pytorch_collectives.py
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== Setup: .venv with hvdplus, PyTorch and TensorFlow (CPU builds), mpi4py and Open MPI, tqdm, scikit-learn"
HVDPLUS_EXTRAS=${HVDPLUS_EXTRAS:-torch,tensorflow,mpi,examples} bash scripts/setup.sh

# TensorFlow's notice that oneDNN is on ignores TF_CPP_MIN_LOG_LEVEL; this small CNN does without oneDNN.
export TF_ENABLE_ONEDNN_OPTS=0
# A rank waiting in MPI yields its core: the ranks may share few cores.
export OMPI_MCA_mpi_yield_when_idle=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# 1 process, global batch 64 and learning rate 0.04 as 2 ranks of 32 (0.02 scaled by 2); its output goes to a log,
# shown if it fails.
single_process() {
  local name=$1
  shift
  echo "-- The same on 1 process, 64 images per step: python examples/${name}_train.py --batch-size 64 --lr 0.04"
  if ! .venv/bin/python "examples/${name}_train.py" --batch-size 64 --lr 0.04 --summary-json "$work/$name-1.json" \
    "$@" >"$work/$name-1.log" 2>&1; then
    cat "$work/$name-1.log"
    exit 1
  fi
  grep "^Final test accuracy" "$work/$name-1.log"
}

echo "== PyTorch on 2 ranks: hvdplusrun -np 2 python examples/pytorch_train.py"
.venv/bin/hvdplusrun -np 2 .venv/bin/python examples/pytorch_train.py \
  --checkpoint-dir "$work/pytorch-2" --summary-json "$work/pytorch-2.json"
single_process pytorch --checkpoint-dir "$work/pytorch-1"

echo "== Keras on 2 ranks: hvdplusrun -np 2 python examples/keras_train.py"
.venv/bin/hvdplusrun -np 2 .venv/bin/python examples/keras_train.py \
  --checkpoint "$work/keras-2/best.keras" --summary-json "$work/keras-2.json"
single_process keras --checkpoint "$work/keras-1/best.keras"

.venv/bin/python scripts/demo_summary.py "$work"
echo "Next: every collective once, .venv/bin/hvdplusrun -np 2 .venv/bin/python examples/pytorch_collectives.py;" \
  "the tests, bash scripts/test.sh"
