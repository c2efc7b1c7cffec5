#!/usr/bin/env bash
# Where a hop's time goes inside one process (issue 34): the time from the
# wake-up (io_uring_enter returning after a wait) to the next system call
# (the io_uring_enter that submits the write onward), per kind of wait,
# from `perf trace` of the router's shard or of the agent.
#
# A sim answers like the real engine's timing (first event after TTFT_MS,
# then one event every 2 ms); requests arrive RATE a second, one at a
# time, so the process sleeps between requests as in real-compare.sh
# (cold) and 2 ms between events (warm). Kinds: "in" (the wait that ends
# with a client request: IDLE_MS-ish), "first event" (the wait of TTFT),
# "later events" (the 2 ms waits).
#
# Usage: PROC=router|agent [RATE=20] [TTFT_MS=20] [DUR=4s] scripts/bench/hop-gaps.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/lib.sh
PROC="${PROC:-router}"; RATE="${RATE:-20}"; TTFT_MS="${TTFT_MS:-20}"; DUR="${DUR:-4s}"
command -v perf >/dev/null || { echo "hop-gaps: perf is needed (linux-perf)" >&2; exit 2; }
[ -n "${HN_BIN:-}" ] || { cargo build -q --release --workspace --bins; HN_BIN="$PWD/target/release"; }
HN_WORK="$(mktemp -d -t hivenet-gaps-XXXX)"
trap hn_stop_all EXIT
S=$(hn_free_port); H=$(hn_free_port); M=$(hn_free_port); P=$(hn_free_port)
export HIVENET_ROUTER_ADMIN_API_KEYS=bench-admin
hn_sim "$S" sim-model sim --ttft "${TTFT_MS}ms" --itl 2ms --output-tokens 8
hn_router "$H" "$M" "$P" --shards 1 --no-pin --disk-db-path "$HN_WORK/db"
ROUTER_PID=$HN_LAST_PID
hn_agent "$P" "$S" agent.key agent
AGENT_PID=$HN_LAST_PID
hn_wait_http "http://127.0.0.1:$H/v1/models" 60 '"healthy":1'
bench() { "$HN_BIN/hivenet-bench" --url "http://127.0.0.1:$H" --rate "$RATE" --arrivals constant --duration "$1" \
  --stream --max-tokens 8 --quiet --out "$HN_WORK/bench.json" >/dev/null; }
bench 2s # warm-up
pid=$ROUTER_PID; thread=shard-0
[ "$PROC" = agent ] && { pid=$AGENT_PID; thread=hivenet-agent; }
perf trace -p "$pid" -o "$HN_WORK/trace.txt" 2>/dev/null & TP=$!
sleep 0.5
bench "$DUR"
sleep 0.2; kill -INT "$TP"; wait "$TP" || true
python3 - "$HN_WORK/trace.txt" "$thread" "$TTFT_MS" <<'PY'
import re, statistics, sys
path, thread, ttft = sys.argv[1], sys.argv[2], float(sys.argv[3])
ev = []
for l in open(path):
    m = re.match(r'\s*([\d.]+) \(\s*([\d.]+) ms\): ' + re.escape(thread) + r'/\d+ (?:\.\.\. \[continued\]: )?(\w+)\(', l)
    if m:
        ev.append((float(m.group(1)), float(m.group(2)), m.group(3)))
ev.sort()
kinds = {"in": [], "first event": [], "later events": []}
for (t, d, name), nxt in zip(ev, ev[1:]):
    if name != "io_uring_enter":
        continue
    gap = (nxt[0] - (t + d)) * 1000
    if ttft - 1 <= d <= ttft + 3:
        kinds["first event"].append(gap)
    elif 1.5 <= d <= 2.5:
        kinds["later events"].append(gap)
    elif d > 5:
        kinds["in"].append(gap)
print(f"{thread}: from the wake-up to the next system call, us (perf trace; its own cost included)")
for k, v in kinds.items():
    if v:
        v.sort()
        print(f"  {k:13} n={len(v):4}  median {statistics.median(v):5.0f}  p90 {v[int(len(v) * .9)]:5.0f}")
PY
