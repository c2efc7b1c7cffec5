#!/usr/bin/env bash
# Price of client keys and quotas: the same release build twice against the
# same sim, "hivenet" with auth off and "hivenet-before" with an auth.yaml
# of 10,000 keys (the bench's key has a flat requests-per-minute and
# tokens-per-day quota, so every request authenticates, takes an RPM token
# and charges and trues up its daily tokens). One connection and open loop,
# interleaved rounds; router CPU per request from /proc.
#
# usage: scripts/bench/auth.sh            (ROUNDS, DUR, RATES as bench-compare.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build -q --release --workspace --bins
KEYS="$(mktemp -t hivenet-auth10k-XXXX.yaml)"
python3 scripts/bench/gen-auth-keys.py "$KEYS"
STAMP="$(date -u +%Y-%m-%d)"
for s in one-conn open; do
  BEFORE_BIN="$PWD/target/release" BEFORE_ARGS="--auth-config-file $KEYS" BENCH_ARGS="--api-key sk-bench-key" SKIP_PEERS=1 \
    OUT="perf/$STAMP-auth-$s" scripts/bench/compare.sh "$s"
  # The same with the roles swapped ("hivenet" = auth on), so an order
  # effect inside a round cancels out between the two runs.
  BEFORE_BIN="$PWD/target/release" MAIN_ARGS="--auth-config-file $KEYS" BENCH_ARGS="--api-key sk-bench-key" SKIP_PEERS=1 \
    OUT="perf/$STAMP-auth-$s-swapped" scripts/bench/compare.sh "$s"
done
rm -f "$KEYS"
