#!/usr/bin/env bash
# The router's user-space instructions per proxied request (callgrind Ir),
# non-streaming chat at one connection: a count, not a time, so it does
# not move with a noisy neighbour. Starts hivenet-sim, the router under
# valgrind (--shards 1) and an agent, warms up, zeroes the counters,
# drives DUR of closed-loop requests with hivenet-bench and divides.
#
# usage: scripts/bench/callgrind-request.sh
#   BIN=target/release (default; build first, with `debug = 1` as in Cargo.toml)
#   DUR=3s             measured run (under valgrind ~300 requests/s)
#   KEEP=dir           keep the callgrind output there (for callgrind_annotate)
# Figures and what they showed: perf/2026-12-01-router-cpu-profile.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN="${BIN:-target/release}"
DUR="${DUR:-3s}"
command -v valgrind >/dev/null || { echo "callgrind-request: install valgrind" >&2; exit 2; }
W=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$W"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
SIM=$(free_port); HTTP=$(free_port); MET=$(free_port); P2P=$(free_port)
export HIVENET_ROUTER_ADMIN_API_KEYS=callgrind-admin
"$BIN/hivenet-sim" --port "$SIM" --model sim-model --threads 1 >"$W/sim.log" 2>&1 & PIDS+=($!)
valgrind --tool=callgrind --callgrind-out-file="$W/cg.out" "$BIN/hivenet-router" \
  --http-port "127.0.0.1:$HTTP" --metrics-port "127.0.0.1:$MET" --p2p-port "$P2P" --shards 1 \
  --disk-db-path "$W/db" >"$W/router.log" 2>&1 & R=$!; PIDS+=($R)
for _ in $(seq 1 200); do curl -sf "http://127.0.0.1:$HTTP/health" >/dev/null 2>&1 && break; sleep 0.3; done
"$BIN/hivenet-agent" --router-p2p "127.0.0.1:$P2P" --backend-url "http://127.0.0.1:$SIM" \
  --identity-path "$W/agent.key" --capacity 1024 >"$W/agent.log" 2>&1 & PIDS+=($!)
for _ in $(seq 1 200); do
  curl -s -H "Authorization: Bearer $HIVENET_ROUTER_ADMIN_API_KEYS" "http://127.0.0.1:$HTTP/admin/models" \
    | grep -q sim-model && break
  sleep 0.3
done
"$BIN/hivenet-bench" --url "http://127.0.0.1:$HTTP" --quiet --duration 2s --connections 1 >/dev/null
callgrind_control -z "$R" >/dev/null 2>&1
"$BIN/hivenet-bench" --url "http://127.0.0.1:$HTTP" --quiet --duration "$DUR" --connections 1 --out "$W/b.json" >/dev/null
callgrind_control -d "$R" >/dev/null 2>&1
sleep 1
ok=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['ok'])" "$W/b.json")
ir=$(grep -h "^totals:" "$W"/cg.out.* | awk '{s+=$2} END {print s}')
echo "requests $ok  Ir $ir  Ir/request $((ir / ok))"
if [ -n "${KEEP:-}" ]; then mkdir -p "$KEEP" && cp "$W"/cg.out.* "$KEEP"/; fi
