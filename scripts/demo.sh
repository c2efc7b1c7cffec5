#!/usr/bin/env bash
# The main job, end to end: a router (2 shards), two simulated backends with
# different speeds, two agents; a handful of chat requests (streaming and
# not); the per-agent counts; then everything is stopped by PID.
set -euo pipefail
HIVENET_ROUTER_ADMIN_API_KEY_DEMO="demo-admin-$(date +%s%N)"
export HIVENET_ROUTER_ADMIN_API_KEYS="$HIVENET_ROUTER_ADMIN_API_KEY_DEMO"
cd "$(dirname "$0")/.."
PROFILE="${PROFILE:-debug}"
if [ "$PROFILE" = release ]; then cargo build -q --release --workspace --bins; else cargo build -q --workspace --bins; fi
BIN="target/$PROFILE"
WORK="$(mktemp -d -t hivenet-demo-XXXX)"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  echo "== stopped ${#PIDS[@]} processes; logs in $WORK"
}
trap cleanup EXIT

HTTP=18080; METRICS=12112; P2P=19000; S1=18881; S2=18882
echo "== starting two hivenet-sim backends (ttft 20ms and 60ms), router, two agents"
"$BIN/hivenet-sim" --port $S1 --model demo-model --ttft 20ms --itl 5ms >"$WORK/sim1.log" 2>&1 & PIDS+=($!)
"$BIN/hivenet-sim" --port $S2 --model demo-model --ttft 60ms --itl 5ms >"$WORK/sim2.log" 2>&1 & PIDS+=($!)
"$BIN/hivenet-router" --http-port 127.0.0.1:$HTTP --metrics-port 127.0.0.1:$METRICS --p2p-port $P2P --disk-db-path "$WORK/hivenet-data" >"$WORK/router.log" 2>&1 & PIDS+=($!)
"$BIN/hivenet-agent" --router-p2p /ip4/127.0.0.1/tcp/$P2P --backend-url http://127.0.0.1:$S1 --identity-path "$WORK/agent1.key" --machine sim-1 >"$WORK/agent1.log" 2>&1 & PIDS+=($!)
"$BIN/hivenet-agent" --router-p2p /ip4/127.0.0.1/tcp/$P2P --backend-url http://127.0.0.1:$S2 --identity-path "$WORK/agent2.key" --machine sim-2 >"$WORK/agent2.log" 2>&1 & PIDS+=($!)

for _ in $(seq 1 100); do
  if curl -sf "http://127.0.0.1:$HTTP/v1/models" | grep -q '"healthy":2'; then break; fi
  sleep 0.1
done
grep -h "shard-\|agent registered" "$WORK/router.log" | sed 's/^/   router | /'
echo "== GET /v1/models"
curl -s "http://127.0.0.1:$HTTP/v1/models"; echo
for i in 1 2 3; do
  echo "== non-streaming chat #$i"
  curl -s "http://127.0.0.1:$HTTP/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model":"demo-model","messages":[{"role":"user","content":"Say hello"}],"max_tokens":8}'; echo
done
for i in 1 2 3; do
  echo "== streaming chat #$i (events as they arrive)"
  curl -sN "http://127.0.0.1:$HTTP/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model":"demo-model","stream":true,"messages":[{"role":"user","content":"Say hello"}],"max_tokens":4}' | grep -o '"content":"[^"]*"' | tr '\n' ' '; echo
done
echo "== requests served per agent (from /metrics)"
curl -s "http://127.0.0.1:$METRICS/metrics" | grep '^hivenet_agent_requests_success_total' \
  | sed -E 's/.*peer_id="([^"]+)".*machine="([^"]+)".* ([0-9]+)$/   \2 (\1): \3/'
echo "== latency per agent (GET /admin/routing-table)"
TABLE="$(curl -s -H "Authorization: Bearer $HIVENET_ROUTER_ADMIN_API_KEY_DEMO" "http://127.0.0.1:$HTTP/admin/routing-table")"
if command -v python3 >/dev/null 2>&1; then
  printf '%s' "$TABLE" | python3 -c 'import json,sys; t=json.load(sys.stdin)
for a in t["agents"]:
    u=a["universal"]; print("   %s %s: %s srtt=%s ms rttvar=%s ms ok=%d" % (a["metadata"].get("machine",""), a["peer_id"][:16], u["latency_state"], u["srtt_ms"] and round(u["srtt_ms"],2), u["rttvar_ms"] and round(u["rttvar_ms"],2), u["successful_requests_total"]))'
else
  echo "   $TABLE"
fi
echo "== requests served per shard"
curl -s "http://127.0.0.1:$METRICS/metrics" | grep '^hivenet_shard_requests_total' | sed 's/^/   /'
