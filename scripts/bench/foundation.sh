#!/usr/bin/env bash
# First figure for the foundation: requests/s and CPU per request through
# router+agent against the direct path to hivenet-sim (zero delay), at 1 and
# 32 connections, interleaved A B A B in one run. wrk until hivenet-bench
# lands. Writes perf/<date>-foundation-wrk/.
set -euo pipefail
export HIVENET_ROUTER_ADMIN_API_KEYS="${HIVENET_ROUTER_ADMIN_API_KEYS:-demo-admin-$(date +%s%N)}"
cd "$(dirname "$0")/../.."
command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk; }
cargo build -q --release --workspace --bins
BIN=target/release
DUR="${DUR:-10s}"
OUT="perf/$(date -u +%Y-%m-%d)-foundation-wrk"
mkdir -p "$OUT/raw"
WORK="$(mktemp -d)"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

SIM=28881; HTTP=28080; MET=22112; P2P=29000
"$BIN/hivenet-sim" --port $SIM --model bench-model --output-tokens 16 >"$WORK/sim.log" 2>&1 & SIM_PID=$!; PIDS+=($SIM_PID)
"$BIN/hivenet-router" --http-port 127.0.0.1:$HTTP --metrics-port 127.0.0.1:$MET --p2p-port $P2P --shards 1 --disk-db-path "$WORK/db" >"$WORK/router.log" 2>&1 & R_PID=$!; PIDS+=($R_PID)
sleep 0.5
"$BIN/hivenet-agent" --router-p2p 127.0.0.1:$P2P --backend-url http://127.0.0.1:$SIM --identity-path "$WORK/a.key" --capacity 1000 >"$WORK/agent.log" 2>&1 & A_PID=$!; PIDS+=($A_PID)
for _ in $(seq 1 100); do curl -sf http://127.0.0.1:$HTTP/v1/models | grep -q '"healthy":1' && break; sleep 0.1; done

cat >"$WORK/post.lua" <<'LUA'
wrk.method = "POST"
wrk.body = '{"model":"bench-model","messages":[{"role":"user","content":"hi"}],"max_tokens":16}'
wrk.headers["Content-Type"] = "application/json"
LUA

ticks() { awk '{print $14+$15}' "/proc/$1/stat"; }
HZ=$(getconf CLK_TCK)
{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(git rev-parse HEAD)"
  echo "nproc: $(nproc)"
  echo "kernel: $(uname -r)"
  echo "rustc: $(rustc --version)"
  echo "wrk: $(wrk -v 2>&1 | head -1)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
} >"$OUT/env.txt"
echo "scripts/bench/foundation.sh (DUR=$DUR)" >"$OUT/cmd.txt"

printf '| path | conns | round | req/s | p50 ms | p99 ms | router us/req | agent us/req | sim us/req |\n|---|---|---|---|---|---|---|---|---|\n' >"$OUT/results.md"
run() { # name url conns round
  local name=$1 url=$2 c=$3 round=$4
  local r0 a0 s0 r1 a1 s1
  r0=$(ticks $R_PID); a0=$(ticks $A_PID); s0=$(ticks $SIM_PID)
  wrk -t1 -c"$c" -d"$DUR" --latency -s "$WORK/post.lua" "$url/v1/chat/completions" >"$OUT/raw/$name-c$c-r$round.txt"
  r1=$(ticks $R_PID); a1=$(ticks $A_PID); s1=$(ticks $SIM_PID)
  local f="$OUT/raw/$name-c$c-r$round.txt"
  local total rps p50 p99
  total=$(awk '/requests in/ {print $1}' "$f")
  rps=$(awk '/Requests\/sec/ {print $2}' "$f")
  p50=$(awk '$1=="50%" {print $2}' "$f")
  p99=$(awk '$1=="99%" {print $2}' "$f")
  local us='-'
  cpu() { awk -v d="$1" -v n="$total" -v hz="$HZ" 'BEGIN { if (n>0) printf "%.1f", d*1e6/hz/n; else print "-" }'; }
  local ru au su
  if [ "$name" = router ]; then ru=$(cpu $((r1-r0))); au=$(cpu $((a1-a0))); else ru='-'; au='-'; fi
  su=$(cpu $((s1-s0)))
  echo "| $name | $c | $round | $rps | $p50 | $p99 | $ru | $au | $su |" >>"$OUT/results.md"
}
for c in 1 32; do
  for round in 1 2; do
    run direct "http://127.0.0.1:$SIM" $c $round
    run router "http://127.0.0.1:$HTTP" $c $round
  done
done
cat "$OUT/results.md"
echo "written to $OUT"
