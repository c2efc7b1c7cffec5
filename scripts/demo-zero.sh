#!/usr/bin/env bash
# Hold at zero, start to finish, on this machine: a router for site "a"
# with a sibling map that places "zero-model" here with scale_from_zero, no
# backend running; a tiny autoscaler that reads hivenet_pending_demand
# from /metrics and starts a simulated backend and its agent when it rises
# (3 s cold start), then stops them after 10 s without traffic; a client
# whose streaming request is held (keepalives every 2 s) and then served.
# Prints the timeline.
#
# usage: scripts/demo-zero.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q --workspace --bins
B="$PWD/target/debug"
W="$(mktemp -d -t hivenet-zero-XXXX)"
HTTP=18480 METRICS=18481 P2P=18482 SIM=18483
export HIVENET_ROUTER_ADMIN_API_KEYS=demo-admin
PIDS=()
cleanup() {
  for f in "$W/agent.pid" "$W/sim.pid"; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
t0=$(date +%s.%N)
say() { awk -v a="$(date +%s.%N)" -v b="$t0" -v m="$*" 'BEGIN { printf "%6.2fs  %s\n", a - b, m }'; }

(cd "$W" && exec "$B/hivenet-router" --http-port 127.0.0.1:$HTTP --metrics-port 127.0.0.1:$METRICS \
  --p2p-port $P2P --site-id a --wake-keepalive 2s >router.log 2>&1) & PIDS+=($!)
for _ in $(seq 1 100); do curl -sf 127.0.0.1:$HTTP/health >/dev/null && break; sleep 0.1; done
curl -sf -X PUT -H "Authorization: Bearer demo-admin" 127.0.0.1:$HTTP/admin/sibling-map -d "{
  \"version\": \"1\", \"sites\": [{\"site_id\": \"a\", \"base_url\": \"http://127.0.0.1:$HTTP\"}],
  \"placements\": [{\"site_id\": \"a\", \"model\": \"zero-model\", \"kind\": \"chat\",
                    \"scale_from_zero\": true, \"hold_budget\": \"2m\"}]}" >/dev/null
say "router up, map pushed: zero-model placed here with scale_from_zero, no backend"

# The autoscaler: wake on demand, sleep after 10 s idle.
(
  up=0; idle_since=""
  metric() { curl -s 127.0.0.1:$METRICS/metrics | awk -v n="$1" 'index($0, n) == 1 {s += $2} END {print s + 0}'; }
  while true; do
    demand=$(metric 'hivenet_pending_demand{model="zero-model"}')
    routed=$(metric 'hivenet_routing_requests_routed_total{')
    if [ "$up" = 0 ] && [ "${demand%.*}" -gt 0 ]; then
      say "autoscaler: pending demand $demand, scaling zero-model from 0 to 1 (cold start 3s)"
      "$B/hivenet-sim" --port $SIM --model zero-model --ttft 100ms --itl 50ms --output-tokens 8 --startup-delay 3s >"$W/sim.log" 2>&1 &
      echo $! >"$W/sim.pid"
      (cd "$W" && exec "$B/hivenet-agent" --router-p2p /ip4/127.0.0.1/tcp/$P2P --backend-url http://127.0.0.1:$SIM \
        --identity-path "$W/agent.key" >agent.log 2>&1) & echo $! >"$W/agent.pid"
      up=1; last_routed=$routed; idle_since=$(date +%s)
    elif [ "$up" = 1 ]; then
      if [ "$routed" != "$last_routed" ] || [ "${demand%.*}" -gt 0 ]; then
        last_routed=$routed; idle_since=$(date +%s)
      elif [ $(( $(date +%s) - idle_since )) -ge 10 ]; then
        say "autoscaler: 10s without traffic, scaling zero-model to 0"
        kill "$(cat "$W/agent.pid")" "$(cat "$W/sim.pid")" 2>/dev/null || true
        up=0
      fi
    fi
    sleep 0.5
  done
) & PIDS+=($!)

say "client: POST /v1/chat/completions (stream) for zero-model"
curl -sS -N 127.0.0.1:$HTTP/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{"model":"zero-model","stream":true,"messages":[{"role":"user","content":"hello"}]}' |
while IFS= read -r line; do
  case "$line" in
    ": keep-alive") say "client: keepalive (held)";;
    "data: [DONE]") say "client: stream done";;
    data:*) [ -z "${first:-}" ] && { say "client: first token (served)"; first=1; };;
  esac
done
say "waiting for the idle window..."
for _ in $(seq 1 40); do
  if ! kill -0 "$(cat "$W/agent.pid" 2>/dev/null)" 2>/dev/null; then break; fi
  sleep 0.5
done
sleep 1
say "pending demand now: $(curl -s 127.0.0.1:$METRICS/metrics | grep '^hivenet_pending_demand' )"
say "holds: $(curl -s 127.0.0.1:$METRICS/metrics | grep '^hivenet_wake_holds_total' | tr '\n' ' ')"
say "done (logs in $W)"
