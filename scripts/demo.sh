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
. scripts/lib.sh
HN_BIN="target/$PROFILE"
HN_WORK="$(mktemp -d -t hivenet-demo-XXXX)"
cleanup() {
  hn_stop_all
  echo "== stopped ${#HN_PIDS[@]} processes; logs in $HN_WORK"
}
trap cleanup EXIT

HTTP=18080; METRICS=12112; P2P=19000; S1=18881; S2=18882
echo "== starting two hivenet-sim backends (ttft 20ms and 60ms), router, two agents"
hn_sim $S1 demo-model sim1 --ttft 20ms --itl 5ms
hn_sim $S2 demo-model sim2 --ttft 60ms --itl 5ms
hn_router $HTTP $METRICS $P2P --disk-db-path "$HN_WORK/hivenet-data"
hn_agent $P2P $S1 agent1.key agent1 --machine sim-1
hn_agent $P2P $S2 agent2.key agent2 --machine sim-2
hn_wait_http "http://127.0.0.1:$HTTP/v1/models" 10 '"healthy":2'
grep -h "shard-\|agent registered" "$HN_WORK/router.log" | sed 's/^/   router | /'
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
