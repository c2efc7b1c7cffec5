#!/usr/bin/env bash
# One agent shared by several routers (issue 31): 1, 2 and 4 routers in
# front of one hivenet-sim engine whose agent declares --capacity CAP;
# hivenet-bench drives every router at once, closed loop, with CONNS
# connections in all split evenly (always more than CAP: every router has
# requests waiting the whole run). Per router count: served rate, the
# engine's peak requests in flight (must never exceed CAP: counted at the
# engine), its mean occupancy over the run (busy slot seconds / (CAP x
# seconds): 1.00 is no slot ever idle) and the routers' full refusals.
# Writes OUT/summary.md.
# Usage: ROUTERS="1 2 4" CAP=4 CONNS=16 DUR=20s scripts/bench/multi-router.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUTERS="${ROUTERS:-1 2 4}"; CAP="${CAP:-4}"; CONNS="${CONNS:-16}"; DUR="${DUR:-20s}"
SIM_FLAGS="${SIM_FLAGS:---ttft 100ms --itl 10ms --output-tokens 16}"
OUT="${OUT:-perf/$(date -u +%Y-%m-%d)-multi-router}"
[ -n "${HN_BIN:-}" ] || { cargo build -q --release --workspace --bins; HN_BIN="$PWD/target/release"; }
. scripts/lib.sh
mkdir -p "$OUT/reports"
export HIVENET_ROUTER_ADMIN_API_KEYS=bench-admin HIVENET_ROUTER_AUDIT_LOG_PATH=off
{
  echo "date: $(date -u +%FT%TZ)"; echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (dirty)')"
  echo "nproc: $(nproc)"; echo "kernel: $(uname -r)"; echo "rustc: $(rustc --version)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
  echo "sim: $SIM_FLAGS"; echo "agent: --capacity $CAP"
  echo "bench: closed loop, $CONNS connections in all split over the routers, --max-tokens 16, --duration $DUR"
} >"$OUT/env.txt"
echo "ROUTERS=\"$ROUTERS\" CAP=$CAP CONNS=$CONNS DUR=$DUR scripts/bench/multi-router.sh" >"$OUT/cmd.txt"
sim_value() { curl -sf "http://127.0.0.1:$1/metrics" | awk -v n="$2" '$1 == n {print $2}'; }
echo "| routers | connections each | served /s | errors | engine peak in flight | engine occupancy | full refusals | p50 / p95 ms |" >"$OUT/summary.md"
echo "|---|---|---|---|---|---|---|---|" >>"$OUT/summary.md"
for n in $ROUTERS; do
  HN_WORK="$(mktemp -d -t hivenet-mr-XXXX)"; HN_PIDS=()
  trap hn_stop_all EXIT
  HTTPS=(); METS=(); P2PS=()
  for i in $(seq 1 "$n"); do
    h=$(hn_free_port); m=$(hn_free_port); p=$(hn_free_port)
    HTTPS+=("$h"); METS+=("$m"); P2PS+=("$p")
    mkdir -p "$HN_WORK/r$i"
    hn_start hivenet-router "router-$i" --http-port "127.0.0.1:$h" --metrics-port "127.0.0.1:$m" \
      --p2p-port "$p" --disk-db-path "$HN_WORK/r$i/db" --identity-path "$HN_WORK/r$i/id.key" --shards 1
  done
  SIM=$(hn_free_port)
  # shellcheck disable=SC2086
  hn_sim "$SIM" sim-model sim $SIM_FLAGS
  EXTRA=()
  for p in "${P2PS[@]:1}"; do EXTRA+=(--router-p2p "/ip4/127.0.0.1/tcp/$p"); done
  hn_agent "${P2PS[0]}" "$SIM" agent.key agent --capacity "$CAP" --warmup off "${EXTRA[@]}"
  for h in "${HTTPS[@]}"; do hn_wait_http "http://127.0.0.1:$h/v1/models" 60 '"healthy":1'; done
  busy0=$(sim_value "$SIM" hivenet_sim_busy_slot_seconds_total)
  t0=$(date +%s.%N)
  each=$(( CONNS / n ))
  BPIDS=()
  for i in $(seq 1 "$n"); do
    "$HN_BIN/hivenet-bench" --url "http://127.0.0.1:${HTTPS[$((i-1))]}" --model sim-model \
      --connections "$each" --duration "$DUR" --max-tokens 16 --stream --quiet \
      --out "$OUT/reports/routers-$n-r$i.json" >"$HN_WORK/bench-$i.txt" 2>&1 &
    BPIDS+=($!)
  done
  for b in "${BPIDS[@]}"; do wait "$b"; done
  t1=$(date +%s.%N)
  busy1=$(sim_value "$SIM" hivenet_sim_busy_slot_seconds_total)
  peak=$(sim_value "$SIM" hivenet_sim_peak_running)
  refusals=0
  for m in "${METS[@]}"; do
    r=$(curl -sf "http://127.0.0.1:$m/metrics" | awk '/^hivenet_agent_full_refusals_total/ {s += $2} END {print s + 0}')
    refusals=$((refusals + ${r%.*}))
  done
  python3 - "$OUT" "$n" "$each" "$busy0" "$busy1" "$t0" "$t1" "$CAP" "$peak" "$refusals" >>"$OUT/summary.md" <<'PY'
import json, sys, glob
out, n, each, b0, b1, t0, t1, cap, peak, refusals = sys.argv[1:]
rs = [json.load(open(f)) for f in sorted(glob.glob(f"{out}/reports/routers-{n}-r*.json"))]
rps = sum(r["achieved_rps"] for r in rs)
errors = sum(r["errors"] for r in rs)
# Latency over all routers' requests: their p50/p95 weighted by count is
# not a percentile; report the worst router's.
p50 = max(r["total"]["p50"] for r in rs)
p95 = max(r["total"]["p95"] for r in rs)
occ = (float(b1) - float(b0)) / (float(cap) * (float(t1) - float(t0)))
print(f"| {n} | {each} | {rps:.1f} | {errors} | {float(peak):.0f} (capacity {cap}) | {occ:.3f} | {refusals} | {p50:,.0f} / {p95:,.0f} |")
PY
  hn_stop_all; HN_PIDS=()
done
cat "$OUT/summary.md"
