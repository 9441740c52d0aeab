#!/usr/bin/env bash
# Installs the SLURM cluster the tests start (tests/slurm_cluster.py): controller, node daemon, accounting daemon,
# munge and MariaDB. Needs root. Idempotent: packages already there are not fetched again. Starts no daemon (the
# Debian packages' maintainer scripts would, so policy-rc.d forbids it during the install).
set -euo pipefail
packages=(slurm-wlm slurm-client slurmdbd munge mariadb-server)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy"
  trap 'rm -f "$policy"' EXIT
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
