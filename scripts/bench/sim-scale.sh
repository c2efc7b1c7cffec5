#!/usr/bin/env bash
# The router in front of 8 to 64 simulated engines that behave like the
# real one (issue 27): each hivenet-sim has the prefix cache and the
# timings calibrated from llama-server (perf/2026-12-02-sim-calibration:
# prefill per uncached token, decode per token, llama.cpp-like 1-token
# blocks, bytes per token), one agent each (--capacity 4); the load is
# multi-turn conversations (hivenet-bench --conversations: applications
# with long system prompts, histories that grow turn by turn), streamed,
# open loop at RATE_PER_AGENT requests/s per agent.
# Per fleet size: throughput, time to first event and to the first
# content token (p50, p90, p99), errors, and the share of prompt tokens the
# engines read from their caches (the router's own per-agent counters:
# hivenet_agent_cached_prompt_tokens_total / hivenet_agent_input_tokens_total).
# Writes OUT/summary.md.
# Usage: AGENTS="8 16 32 64" DUR=30s scripts/bench/sim-scale.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
AGENTS="${AGENTS:-8 16 32 64}"; DUR="${DUR:-40s}"; RATE_PER_AGENT="${RATE_PER_AGENT:-0.5}"
# Conversations open per agent: with the rate and the duration, about 5
# turns each (a conversation's later turns are what a prefix cache serves).
CONV_PER_AGENT="${CONV_PER_AGENT:-4}"
STRATEGY_POLICY="${POLICY_FILE:-}"
# The calibrated engine (perf/2026-12-02-sim-calibration).
# bytes per token 2.0: the bench's filler words tokenize like the
# calibration's "words" kind (1.97).
SIM_FLAGS="${SIM_FLAGS:---ttft 5ms --prefill-per-token 9.65ms --itl 30.8ms --output-tokens 16 --prefix-cache-tokens 4096 --cache-block-tokens 1 --bytes-per-token 2.0}"
BENCH_FLAGS="${BENCH_FLAGS:---apps 4 --system-tokens 64 --turns 6 --prompt-tokens 8-16 --max-tokens 16}"
OUT="${OUT:-perf/$(date -u +%Y-%m-%d)-sim-scale}"
[ -n "${HN_BIN:-}" ] || { cargo build -q --release --workspace --bins; HN_BIN="$PWD/target/release"; }
. scripts/lib.sh
mkdir -p "$OUT/reports"
{
  echo "date: $(date -u +%FT%TZ)"; echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (dirty)')"
  echo "nproc: $(nproc)"; echo "kernel: $(uname -r)"; echo "rustc: $(rustc --version)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
  echo "sim: $SIM_FLAGS"; echo "bench: $BENCH_FLAGS --conversations (agents x $CONV_PER_AGENT) --stream --rate (agents x $RATE_PER_AGENT) --duration $DUR"
  echo "policy: ${STRATEGY_POLICY:-default (least-loaded)}"
} >"$OUT/env.txt"
echo "AGENTS=\"$AGENTS\" DUR=$DUR RATE_PER_AGENT=$RATE_PER_AGENT CONV_PER_AGENT=$CONV_PER_AGENT scripts/bench/sim-scale.sh" >"$OUT/cmd.txt"
export HIVENET_ROUTER_ADMIN_API_KEYS=bench-admin
# The sum of a counter family's values on the router's /metrics.
metric_sum() {
  curl -sf "http://127.0.0.1:$MET/metrics" | awk -v n="$1" 'index($0, n "{") == 1 {s += $NF} END {printf "%.0f", s}'
}
for n in $AGENTS; do
  HN_WORK="$(mktemp -d -t hivenet-scale-XXXX)"; HN_PIDS=()
  HTTP=$(hn_free_port); MET=$(hn_free_port); P2P=$(hn_free_port)
  args=(--disk-db-path "$HN_WORK/db")
  [ -n "$STRATEGY_POLICY" ] && args+=(--policy-file "$STRATEGY_POLICY")
  hn_router "$HTTP" "$MET" "$P2P" "${args[@]}"
  for i in $(seq 1 "$n"); do
    port=$(hn_free_port)
    # shellcheck disable=SC2086
    hn_sim "$port" sim-model "sim-$i" $SIM_FLAGS
    hn_agent "$P2P" "$port" "a$i.key" "agent-$i" --capacity 4 --warmup off
  done
  hn_wait_http "http://127.0.0.1:$HTTP/v1/models" 120 "\"healthy\":$n"
  rate=$(python3 -c "print($n * $RATE_PER_AGENT)")
  # shellcheck disable=SC2086
  "$HN_BIN/hivenet-bench" --url "http://127.0.0.1:$HTTP" --model sim-model --stream --rate "$rate" \
    --duration "$DUR" --timeout 60s --quiet $BENCH_FLAGS --conversations $((n * CONV_PER_AGENT)) --out "$OUT/reports/agents-$n.json" \
    >"$OUT/reports/agents-$n.txt" 2>&1
  echo "$n $(metric_sum hivenet_agent_input_tokens_total) $(metric_sum hivenet_agent_cached_prompt_tokens_total)" \
    >>"$OUT/reports/tokens.txt"
  hn_stop_all
  rm -rf "$HN_WORK"
done
rm -f "$OUT"/reports/*.svg
python3 - "$OUT" <<'PY' | tee "$OUT/summary.md"
import json, sys
out = sys.argv[1]
tokens = {}
for line in open(f"{out}/reports/tokens.txt"):
    n, inp, cached = line.split()
    tokens[int(n)] = (int(inp), int(cached))
print("# Router in front of 8-64 calibrated simulated engines, multi-turn conversations\n")
print("| agents | rate asked /s | served /s | errors | first event p50 / p90 / p99 ms | first content p50 / p90 / p99 ms | cached share of prompt tokens |")
print("|---|---|---|---|---|---|---|")
for n in sorted(tokens):
    j = json.load(open(f"{out}/reports/agents-{n}.json"))
    inp, cached = tokens[n]
    fe, fc = j.get("first_event") or {}, j.get("first_content") or {}
    print(f"| {n} | {j.get('rate', 0):.0f} | {j.get('achieved_rps', 0):.1f} | {j.get('errors', 0)} | "
          f"{fe.get('p50', 0):.1f} / {fe.get('p90', 0):.1f} / {fe.get('p99', 0):.1f} | "
          f"{fc.get('p50', 0):.1f} / {fc.get('p90', 0):.1f} / {fc.get('p99', 0):.1f} | "
          f"{(cached / inp if inp else 0):.1%} ({cached}/{inp}) |")
PY
rm -rf "$OUT/reports"
