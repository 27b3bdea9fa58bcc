#!/usr/bin/env bash
# System packages for the integration tests: a real Slurm (with PMIx, for srun --mpi=pmix), sshd, network
# namespaces, and a Java runtime for Spark (Debian's default, 17 or newer, unless a java is there already). Idempotent: installs only what is missing, and only as root with apt-get; anywhere else it does
# nothing (those tests then skip with the reason).
set -euo pipefail
command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] || exit 0
missing=()
for pkg in slurm-wlm munge libpmix-dev openssh-server openssh-client iproute2; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
command -v java >/dev/null 2>&1 || missing+=(default-jre-headless)
[ ${#missing[@]} -eq 0 ] && exit 0
echo "setup_system.sh: installing ${missing[*]}"
apt-get update -q >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
