#!/usr/bin/env bash
# Side by side on the real engine (issues 27, 34): one llama-server
# (SmolLM2-135M, one thread) asked
#   direct       llama-server itself
#   hivenet      hivenet-router + hivenet-agent --engine llamacpp
#   vllm-router  vllm-router 0.1.17 (PyPI) in front of the same engine
# one request to each target in turn (hivenet-bench --interleave, each
# turn starting one target further), REQS turns a run; a round is a
# streamed run (time to the first content delta, gap between content
# deltas) and a non-streamed run (whole response); one connection per
# target, the same prompt every time (cached by the engine after the first
# request, as in a conversation), temperature 0.
# Writes OUT/summary.md (medians over rounds of each round's p50).
# Usage: ROUNDS=30 REQS=20 scripts/bench/real-compare.sh
#   ENGINE_CPU=1 PROXY_CPU=0: pin the engine and the proxies apart.
#   CAPTURE=1: also capture the loopback packets (tcpdump) and write
#   OUT/hops.md: each proxy's own time per hop, from the kernel's send
#   stamps (scripts/bench/real-hops.py), free of the engine's spread;
#   KEEP_PCAP=FILE keeps the capture (OUT/hops-cmd.txt re-reads it).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS="${ROUNDS:-30}"; REQS="${REQS:-20}"; MAX_TOKENS="${MAX_TOKENS:-8}"
OUT="${OUT:-perf/$(date -u +%Y-%m-%d)-real-compare}"
VENV="${BENCH_VENV:-.venv-bench}"
[ -x "$VENV/bin/vllm-router" ] || { python3 -m venv "$VENV"; "$VENV/bin/pip" install -q --disable-pip-version-check vllm-router==0.1.17; }
# HN_BIN=DIR: binaries of another build (say, the one before a change).
[ -n "${HN_BIN:-}" ] || { cargo build -q --release --workspace --bins; HN_BIN="$PWD/target/release"; }
. scripts/lib.sh
eval "$(scripts/install-llama.sh)"
HN_WORK="$(mktemp -d -t hivenet-real-XXXX)"
trap hn_stop_all EXIT
mkdir -p "$OUT/reports"
# Prefixes, not a function: a background function is a subshell, and its
# PID ($!) is not the server's.
ON_ENGINE=(); ON_PROXY=()
[ -n "${ENGINE_CPU:-}" ] && ON_ENGINE=(taskset -c "$ENGINE_CPU")
[ -n "${PROXY_CPU:-}" ] && ON_PROXY=(taskset -c "$PROXY_CPU")
L=$(hn_free_port); HTTP=$(hn_free_port); MET=$(hn_free_port); P2P=$(hn_free_port)
VR=$(hn_free_port); VRM=$(hn_free_port)
"${ON_ENGINE[@]}" "$LLAMA_SERVER" -m "$LLAMA_MODEL" --host 127.0.0.1 --port "$L" -t 1 -c 2048 -np 1 --metrics \
  >"$HN_WORK/llama.log" 2>&1 &
HN_PIDS+=($!)
hn_wait_http "http://127.0.0.1:$L/health" 120
export HIVENET_ROUTER_ADMIN_API_KEYS=bench-admin
router_args=(--disk-db-path "$HN_WORK/db")
# The engine shares these cores: unpinned shards run on whichever core is
# free (perf/2026-12-02-real-hops); PROXY_CPU pins them all to one.
if [ -n "${PROXY_CPU:-}" ]; then router_args+=(--cpus "$PROXY_CPU"); else router_args+=(--no-pin); fi
hn_router "$HTTP" "$MET" "$P2P" "${router_args[@]}"
hn_agent "$P2P" "$L" agent.key agent --engine llamacpp --warmup off
[ -n "${PROXY_CPU:-}" ] && taskset -a -p -c "$PROXY_CPU" "$HN_LAST_PID" >/dev/null
hn_wait_http "http://127.0.0.1:$HTTP/v1/models" 60 '"healthy":1'
TARGETS="direct:$L hivenet:$HTTP"
# BEFORE_BIN=DIR: also the router and agent of that build ("hivenet-before"),
# so a change is compared with its predecessor in the same run.
if [ -n "${BEFORE_BIN:-}" ]; then
  BH=$(hn_free_port); BM=$(hn_free_port); BP=$(hn_free_port)
  main_bin="$HN_BIN"; HN_BIN="$BEFORE_BIN"
  hn_router "$BH" "$BM" "$BP" --disk-db-path "$HN_WORK/db-before" ${PROXY_CPU:+--cpus "$PROXY_CPU"}
  hn_agent "$BP" "$L" agent-before.key agent-before --engine llamacpp --warmup off
  [ -n "${PROXY_CPU:-}" ] && taskset -a -p -c "$PROXY_CPU" "$HN_LAST_PID" >/dev/null
  HN_BIN="$main_bin"
  hn_wait_http "http://127.0.0.1:$BH/v1/models" 60 '"healthy":1'
  TARGETS="$TARGETS hivenet-before:$BH"
fi
"${ON_PROXY[@]}" "$VENV/bin/vllm-router" --host 127.0.0.1 --port "$VR" --worker-urls "http://127.0.0.1:$L" \
  --policy round_robin --disable-retries --disable-circuit-breaker --log-level warning --prometheus-port "$VRM" \
  >"$HN_WORK/vllm-router.log" 2>&1 &
HN_PIDS+=($!)
hn_wait_http "http://127.0.0.1:$VR/health" 60 || hn_wait_http "http://127.0.0.1:$VR/v1/models" 30
{
  echo "date: $(date -u +%FT%TZ)"; echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (dirty)')"
  echo "nproc: $(nproc)"; echo "kernel: $(uname -r)"; echo "rustc: $(rustc --version)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
  echo "engine: $LLAMA_SERVER (-t 1 -c 2048 -np 1)${ENGINE_CPU:+ on CPU $ENGINE_CPU}"; echo "model: $LLAMA_MODEL"
  echo "vllm-router: $("$VENV/bin/pip" show vllm-router 2>/dev/null | awk '/^Version/ {print $2}')${PROXY_CPU:+ on CPU $PROXY_CPU}"
  echo "binaries: $HN_BIN${BEFORE_BIN:+; hivenet-before: $BEFORE_BIN}"
  if [ -n "${PROXY_CPU:-}" ]; then echo "hivenet: router --cpus $PROXY_CPU, agent on CPU $PROXY_CPU"; else echo "hivenet: router --no-pin, agent unpinned"; fi
} >"$OUT/env.txt"
echo "${CAPTURE:+CAPTURE=1 }${BEFORE_BIN:+BEFORE_BIN=$BEFORE_BIN }ROUNDS=$ROUNDS REQS=$REQS MAX_TOKENS=$MAX_TOKENS${ENGINE_CPU:+ ENGINE_CPU=$ENGINE_CPU}${PROXY_CPU:+ PROXY_CPU=$PROXY_CPU} scripts/bench/real-compare.sh" >"$OUT/cmd.txt"
TARGETS="$TARGETS vllm-router:$VR"
NAMES=(); URLS=()
for t in $TARGETS; do NAMES+=("${t%%:*}"); URLS+=("http://127.0.0.1:${t#*:}"); done
others=$(IFS=,; echo "${URLS[*]:1}")
bench() { # KIND [ARGS]: one request to each target in turn, REQS turns
  local kind="$1"; shift
  "${ON_PROXY[@]}" "$HN_BIN/hivenet-bench" --url "${URLS[0]}" --interleave "$others" --connections 1 \
    --requests "$REQS" --model "$LLAMA_MODEL" --same-prompt --temperature 0 --prompt-tokens 24 \
    --max-tokens "$MAX_TOKENS" --timeout 60s --quiet --out "$OUT/reports/turns-r$r-$kind.json" "$@" \
    >"$OUT/reports/turns-r$r-$kind.txt" 2>&1
  local k
  for k in "${!NAMES[@]}"; do
    local from="$OUT/reports/turns-r$r-$kind-$k.json"; [ "$k" = 0 ] && from="$OUT/reports/turns-r$r-$kind.json"
    mv "$from" "$OUT/reports/r$r-${NAMES[$k]}-$kind.json"
  done
}
if [ -n "${CAPTURE:-}" ]; then
  command -v tcpdump >/dev/null || { echo "CAPTURE=1 needs tcpdump (Debian package tcpdump)" >&2; exit 1; }
  ports="port $L"
  HOPS=()
  for t in $TARGETS; do
    p="${t#*:}"; [ "$p" = "$L" ] || ports="$ports or port $p"
    case "${t%%:*}" in
      hivenet) HOPS+=("hivenet:$p:$P2P"); ports="$ports or port $P2P" ;;
      hivenet-before) HOPS+=("hivenet-before:$p:$BP"); ports="$ports or port $BP" ;;
      *) HOPS+=("${t%%:*}:$p") ;;
    esac
  done
  tcpdump -i lo -s 0 --time-stamp-precision=nano -w "$HN_WORK/cap.pcap" "tcp and ($ports)" \
    >"$HN_WORK/tcpdump.log" 2>&1 &
  CAP_PID=$!
  HN_PIDS+=("$CAP_PID")
  sleep 1
fi
# One turn first: the engine caches the prompt.
r=0; REQS_MAIN="$REQS"; REQS=1; bench warm --stream; REQS="$REQS_MAIN"
for r in $(seq 1 "$ROUNDS"); do
  bench stream --stream
  bench whole
done
if [ -n "${CAPTURE:-}" ]; then
  kill -INT "$CAP_PID"; wait "$CAP_PID" 2>/dev/null || true
  echo "python3 scripts/bench/real-hops.py CAPTURE.pcap $L ${HOPS[*]}" >"$OUT/hops-cmd.txt"
  python3 scripts/bench/real-hops.py "$HN_WORK/cap.pcap" "$L" "${HOPS[@]}" | tee "$OUT/hops.md"
  # The capture itself is regenerable and large; keep it only when asked.
  if [ -n "${KEEP_PCAP:-}" ]; then cp "$HN_WORK/cap.pcap" "$KEEP_PCAP"; fi
fi
rm -f "$OUT"/reports/*.svg "$OUT"/reports/r0-* "$OUT"/reports/turns-r0-*
python3 scripts/bench/real-summary.py "$OUT" "$ROUNDS" "${NAMES[@]}" | tee "$OUT/summary.md"
# The raw reports are regenerable and large: keep the summary only.
tar -czf "$OUT/reports.tar.gz" -C "$OUT" reports && rm -rf "$OUT/reports"
