#!/usr/bin/env bash
# Price of admission: the same release build twice against the same sim,
# without a policy and with scripts/bench/admission-policy.yaml (every gate on,
# none refusing), one connection and open loop, and again with the roles
# swapped so an order effect inside a round cancels. Router CPU per
# request from /proc; instructions per request: scripts/bench/callgrind-admission.sh.
#
# usage: scripts/bench/admission.sh       (ROUNDS, DUR, RATES as bench-compare.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build -q --release --workspace --bins
P="$PWD/scripts/bench/admission-policy.yaml"
STAMP="$(date -u +%Y-%m-%d)"
for s in one-conn open; do
  BEFORE_BIN="$PWD/target/release" BEFORE_ARGS="--policy-file $P" SKIP_PEERS=1 \
    OUT="perf/$STAMP-admission-$s" scripts/bench/compare.sh "$s"
  BEFORE_BIN="$PWD/target/release" MAIN_ARGS="--policy-file $P" SKIP_PEERS=1 \
    OUT="perf/$STAMP-admission-$s-swapped" scripts/bench/compare.sh "$s"
done
