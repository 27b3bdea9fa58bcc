#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite: unit tests and real 2- and 3-rank jobs over MPI and Gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_system.sh
exec .venv/bin/python -m pytest -q "$@"
