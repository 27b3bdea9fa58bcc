#!/usr/bin/env bash
# Simulated hosts for benchmarks and tests: network namespaces joined by a bridge, each with its own sshd and
# host name (hostA, hostB, ...), links shaped with tc. Needs root, iproute2 and openssh-server.
#   scripts/topology.sh up [--hosts N] [--slots K] [--rate 1gbit] [--delay 0.2ms] [--prefix NAME]
#   scripts/topology.sh down|status|measure [--prefix NAME]
# The work is done by tests/integration/netns_hosts.py (shared with the integration tests' fixture).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY=python3
cd "$ROOT"
exec "$PY" -m tests.integration.netns_hosts "$@"
