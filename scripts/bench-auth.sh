#!/usr/bin/env bash
# Price of client keys and quotas: the same release build twice against the
# same sim, "hivenet" with auth off and "hivenet-before" with an auth.yaml
# of 10,000 keys (the bench's key has a flat requests-per-minute and
# tokens-per-day quota, so every request authenticates, takes an RPM token
# and charges and trues up its daily tokens). One connection and open loop,
# interleaved rounds; router CPU per request from /proc.
#
# usage: scripts/bench-auth.sh            (ROUNDS, DUR, RATES as bench-compare.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q --release --workspace --bins
KEYS="$(mktemp -t hivenet-auth10k-XXXX.yaml)"
python3 - "$KEYS" <<'PY'
import hashlib, os, sys
with open(sys.argv[1], "w") as f:
    f.write("api:\n  mode: api-key\n  keys:\n")
    for i in range(9999):
        h = hashlib.sha256(os.urandom(32)).hexdigest()
        f.write(f'    - key_hash: "{h}"\n      metadata: {{name: k{i}, owner: tenant-{i % 500}}}\n      quota: {{requests_per_minute: 1000, tokens_per_day: 1000000}}\n')
    h = hashlib.sha256(b"sk-bench-key").hexdigest()
    f.write(f'    - key_hash: "{h}"\n      metadata: {{name: bench, owner: bench}}\n      quota: {{requests_per_minute: 1000000000, tokens_per_day: 1000000000000}}\n')
PY
STAMP="$(date -u +%Y-%m-%d)"
for s in one-conn open; do
  BEFORE_BIN="$PWD/target/release" BEFORE_ARGS="--auth-config-file $KEYS" BENCH_ARGS="--api-key sk-bench-key" SKIP_PEERS=1 \
    OUT="perf/$STAMP-auth-$s" scripts/bench-compare.sh "$s"
  # The same with the roles swapped ("hivenet" = auth on), so an order
  # effect inside a round cancels out between the two runs.
  BEFORE_BIN="$PWD/target/release" MAIN_ARGS="--auth-config-file $KEYS" BENCH_ARGS="--api-key sk-bench-key" SKIP_PEERS=1 \
    OUT="perf/$STAMP-auth-$s-swapped" scripts/bench-compare.sh "$s"
done
rm -f "$KEYS"
