#!/usr/bin/env bash
# Router memory with prefix-aware routing and the affinity table at its
# ceiling (issue 30): unique prompts (every request a new prefix) as fast
# as two simulated engines answer, closed loop, for MINUTES minutes; the
# router's RSS sampled every 10 s. --affinity-table-entries 1024: the
# table is full within the first second, so every later request replaces
# entries. Prints the samples and the ratio of the last minute's mean to
# the first minute's (after the warm-up).
# Usage: MINUTES=10 perf/2026-12-03-affinity-soak/soak.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
MINUTES="${MINUTES:-10}"; echo "entries ${ENTRIES:-1024}, minutes $MINUTES"
HN_BIN="${HN_BIN:-$PWD/target/release}"
. scripts/lib.sh
HN_WORK="$(mktemp -d -t hivenet-aff-soak-XXXX)"; HN_PIDS=()
trap hn_stop_all EXIT
export HIVENET_ROUTER_ADMIN_API_KEYS=soak-admin HIVENET_ROUTER_AUDIT_LOG_PATH=off
printf 'routing_policy:\n  strategy: prefix-aware\n' >"$HN_WORK/policy.yaml"
HTTP=$(hn_free_port); MET=$(hn_free_port); P2P=$(hn_free_port)
hn_router "$HTTP" "$MET" "$P2P" --disk-db-path "$HN_WORK/db" --policy-file "$HN_WORK/policy.yaml" \
  --affinity-table-entries "${ENTRIES:-1024}"
for i in 1 2; do
  port=$(hn_free_port)
  hn_sim "$port" sim-model "sim-$i" --prefix-cache-tokens 4096 --output-tokens 4
  hn_agent "$P2P" "$port" "a$i.key" "agent-$i" --capacity 64 --warmup off
done
hn_wait_http "http://127.0.0.1:$HTTP/v1/models" 60 '"healthy":2'
RPID=$(pgrep -f "hivenet-router --http-port 127.0.0.1:$HTTP" | head -1)
"$HN_BIN/hivenet-bench" --url "http://127.0.0.1:$HTTP" --model sim-model --connections 8 \
  --duration "${MINUTES}m" --prompt-tokens 64-256 --max-tokens 4 --quiet --out "$HN_WORK/bench.json" \
  >"$HN_WORK/bench.txt" 2>&1 &
BENCH=$!
end=$(( $(date +%s) + MINUTES * 60 ))
while [ "$(date +%s)" -lt "$end" ] && kill -0 "$BENCH" 2>/dev/null; do
  sleep 10
  echo "$(date +%s) $(awk '/VmRSS/ {print $2}' /proc/$RPID/status)"
done | tee "$HN_WORK/rss.txt"
wait "$BENCH" || true
head -3 "$HN_WORK/bench.txt"
curl -sf "http://127.0.0.1:$MET/metrics" | grep '^hivenet_affinity_decisions' || true
python3 - "$HN_WORK/rss.txt" <<'PY'
import sys
rows = [l.split() for l in open(sys.argv[1]) if len(l.split()) == 2]
kib = [int(r[1]) for r in rows]
first, last = kib[1:7], kib[-6:]
f, l = sum(first) / len(first), sum(last) / len(last)
print(f"samples {len(kib)}; RSS first minute (after 10 s) {f/1024:.1f} MiB, last minute {l/1024:.1f} MiB, ratio {l/f:.3f}; min {min(kib)/1024:.1f} max {max(kib)/1024:.1f} MiB")
PY
