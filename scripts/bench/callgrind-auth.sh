#!/usr/bin/env bash
# Instructions per request, auth off vs on (10,000 keys; the bench key has
# a flat RPM and daily quota). Note: valgrind hides SHA-NI, so the key hash
# runs in software here (~3,500 instructions) but in hardware natively.
#
# usage: scripts/bench/callgrind-auth.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
W=$(mktemp -d)
python3 scripts/bench/gen-auth-keys.py "$W/auth10k.yaml"
WORKDIR=$W ON_ARGS="--auth-config-file $W/auth10k.yaml" KEY=sk-bench-key exec scripts/bench/callgrind-price.sh
