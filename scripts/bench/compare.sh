#!/usr/bin/env bash
# Side-by-side benchmark harness: the same hivenet-bench load against
#   direct      hivenet-sim itself
#   hivenet     hivenet-router + hivenet-agent (two hops over libp2p)
#   nginx       nginx as a plain reverse proxy (Debian package)
#   vllm-router the Rust router from PyPI (installed in a venv)
# interleaved A B C D A B C D so machine drift cancels; CPU seconds per
# request of every server process from /proc; results in a dated folder.
#
# usage: scripts/bench/compare.sh one-conn|sixteen|first-event|open|stream|shards|all
set -euo pipefail
export HIVENET_ROUTER_ADMIN_API_KEYS="${HIVENET_ROUTER_ADMIN_API_KEYS:-demo-admin-$(date +%s%N)}"
cd "$(dirname "$0")/../.."
SCENARIO="${1:-all}"
ROUNDS="${ROUNDS:-2}"
DUR="${DUR:-8s}"

command -v nginx >/dev/null || { apt-get update -qq && apt-get install -y -qq nginx-light >/dev/null || apt-get install -y -qq nginx >/dev/null; }
VENV="${BENCH_VENV:-.venv-bench}"
[ -x "$VENV/bin/vllm-router" ] || { python3 -m venv "$VENV"; "$VENV/bin/pip" install -q --disable-pip-version-check vllm-router==0.1.17; }
cargo build -q --release --workspace --bins
BIN="$PWD/target/release"

OUT="${OUT:-perf/$(date -u +%Y-%m-%d)-compare-$SCENARIO}"
mkdir -p "$OUT/reports"
WORK="$(mktemp -d -t hivenet-bench-XXXX)"
PIDS=()
stop_all() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done; PIDS=(); }
trap 'stop_all; [ -f "$WORK/nginx.pid" ] && kill "$(cat "$WORK/nginx.pid")" 2>/dev/null || true' EXIT

{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(git rev-parse HEAD)$(git diff --quiet || echo ' (dirty)')"
  echo "nproc: $(nproc)"
  echo "kernel: $(uname -r)"
  echo "rustc: $(rustc --version)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
  echo "nginx: $(nginx -v 2>&1)"
  echo "vllm-router: $("$VENV/bin/pip" show vllm-router 2>/dev/null | awk '/^Version/ {print $2}')"
  [ -n "${BEFORE_BIN:-}" ] && echo "hivenet-before: binaries from $BEFORE_BIN (${BEFORE_COMMIT:-unknown commit})"
} >"$OUT/env.txt"
echo "ROUNDS=$ROUNDS DUR=$DUR ${BEFORE_BIN:+BEFORE_BIN=$BEFORE_BIN }${BEFORE_ARGS:+BEFORE_ARGS=\"$BEFORE_ARGS\" }${MAIN_ARGS:+MAIN_ARGS=\"$MAIN_ARGS\" }${BENCH_ARGS:+BENCH_ARGS=\"$BENCH_ARGS\" }${SKIP_PEERS:+SKIP_PEERS=1 }scripts/bench/compare.sh $SCENARIO" >"$OUT/cmd.txt"
: >"$OUT/cpu.tsv"

wait_http() { for _ in $(seq 1 200); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.05; done; echo "not up: $1" >&2; return 1; }
ticks() { local t=0 p; for p in "$@"; do [ -r "/proc/$p/stat" ] && t=$((t + $(awk '{print $14+$15}' "/proc/$p/stat"))); done; echo $t; }

# --- servers -------------------------------------------------------------
SIM_PIDS=()
start_sims() { # args for the sim; one sim per model in $MODELS
  local port=21881 m
  SIM_PORTS=()
  for m in $MODELS; do
    "$BIN/hivenet-sim" --port $port --model "$m" "$@" >"$WORK/sim-$m.log" 2>&1 & PIDS+=($!); SIM_PIDS+=($!)
    SIM_PORTS+=($port); port=$((port + 1))
  done
  for p in "${SIM_PORTS[@]}"; do wait_http "http://127.0.0.1:$p/health"; done
}
# start_hivenet SHARDS [BIN_DIR PORT_BASE TAG]: router + one agent per model.
start_hivenet() {
  local bin=${2:-$BIN} base=${3:-21} tag=${4:-}
  local extra=()
  [ -n "$tag" ] && [ -n "${BEFORE_ARGS:-}" ] && read -r -a extra <<<"$BEFORE_ARGS"
  [ -z "$tag" ] && [ -n "${MAIN_ARGS:-}" ] && read -r -a extra <<<"$MAIN_ARGS"
  "$bin/hivenet-router" --http-port 127.0.0.1:${base}080 --metrics-port 127.0.0.1:${base}112 --p2p-port ${base}900 --shards "$1" --disk-db-path "$WORK/db$tag" --reset-disk-db "${extra[@]}" >"$WORK/router$tag.log" 2>&1 & local rpid=$!; PIDS+=($!)
  wait_http http://127.0.0.1:${base}080/health
  local apids=() i=0 m
  for m in $MODELS; do
    "$bin/hivenet-agent" --router-p2p 127.0.0.1:${base}900 --backend-url "http://127.0.0.1:${SIM_PORTS[$i]}" --identity-path "$WORK/agent$tag-$m.key" --capacity 100000 >"$WORK/agent$tag-$m.log" 2>&1 & PIDS+=($!); apids+=($!)
    i=$((i + 1))
  done
  for m in $MODELS; do for _ in $(seq 1 200); do curl -s -H "Authorization: Bearer $HIVENET_ROUTER_ADMIN_API_KEYS" http://127.0.0.1:${base}080/admin/models | grep -q "\"id\":\"$m\"" && break; sleep 0.05; done; done
  if [ -z "$tag" ]; then ROUTER_PID=$rpid; AGENT_PIDS=("${apids[@]}"); else BROUTER_PID=$rpid; BAGENT_PIDS=("${apids[@]}"); fi
}
# BEFORE_BIN=<dir with an older build's binaries>: also run that router and
# agent (ports 22xxx) against the same sim, as target "hivenet-before", so a
# change is compared with its predecessor in the same run. BEFORE_ARGS adds
# router flags to that target only, MAIN_ARGS to "hivenet" only (e.g. the same build with
# --auth-config-file, to price a feature); BENCH_ARGS adds hivenet-bench
# flags to every run (e.g. --api-key); SKIP_PEERS=1 leaves nginx and
# vllm-router out.
start_hivenet_before() {
  [ -n "${BEFORE_BIN:-}" ] || return 0
  start_hivenet "$1" "$BEFORE_BIN" 22 -before
}
start_nginx() {
  [ -n "${SKIP_PEERS:-}" ] && return 0
  cat >"$WORK/nginx.conf" <<NGX
worker_processes 1;
pid $WORK/nginx.pid;
error_log $WORK/nginx-error.log warn;
events { worker_connections 8192; }
http {
  access_log off;
  upstream sim { server 127.0.0.1:${SIM_PORTS[0]}; keepalive 256; }
  server {
    listen 127.0.0.1:21180 reuseport;
    location / {
      proxy_pass http://sim;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }
  }
}
NGX
  nginx -c "$WORK/nginx.conf" -p "$WORK"
  wait_http http://127.0.0.1:21180/health
  NGINX_PIDS=("$(cat "$WORK/nginx.pid")" $(pgrep -P "$(cat "$WORK/nginx.pid")"))
}
start_vllm_router() {
  [ -n "${SKIP_PEERS:-}" ] && return 0
  "$VENV/bin/vllm-router" --host 127.0.0.1 --port 21280 --worker-urls "http://127.0.0.1:${SIM_PORTS[0]}" --policy round_robin \
    --disable-retries --disable-circuit-breaker --log-level warning --prometheus-port 21290 >"$WORK/vllm-router.log" 2>&1 & VR_PID=$!; PIDS+=($!)
  wait_http http://127.0.0.1:21280/health || wait_http http://127.0.0.1:21280/v1/models
}

# --- one measured run ----------------------------------------------------
# run NAME TARGET URL PROCNAME:PIDS... -- bench args
run() {
  local name=$1 target=$2 url=$3; shift 3
  local specs=()
  while [ "$1" != "--" ]; do specs+=("$1"); shift; done; shift
  local before=() s
  for s in "${specs[@]}"; do before+=("$(ticks ${s#*:})"); done
  local json="$OUT/reports/$name-$target.json"
  local bargs=()
  [ -n "${BENCH_ARGS:-}" ] && read -r -a bargs <<<"$BENCH_ARGS"
  "$BIN/hivenet-bench" --url "$url" --quiet --out "$json" "$@" "${bargs[@]}" >"$OUT/reports/$name-$target.txt"
  local i=0
  for s in "${specs[@]}"; do
    printf '%s\t%s\t%s\t%s\n' "$name" "$target" "${s%%:*}" "$(( $(ticks ${s#*:}) - ${before[$i]} ))" >>"$OUT/cpu.tsv"
    i=$((i + 1))
  done
  echo "  $name $target: $(head -1 "$OUT/reports/$name-$target.txt")"
}

peers() { # NAME -- bench args : runs all four targets once, interleaved by the caller's rounds
  local name=$1; shift
  run "$name" direct http://127.0.0.1:${SIM_PORTS[0]} "sim:${SIM_PIDS[*]}" -- "$@"
  run "$name" hivenet http://127.0.0.1:21080 "router:$ROUTER_PID" "agent:${AGENT_PIDS[*]}" "sim:${SIM_PIDS[*]}" -- "$@"
  if [ -n "${BEFORE_BIN:-}" ]; then
    run "$name" hivenet-before http://127.0.0.1:22080 "router:$BROUTER_PID" "agent:${BAGENT_PIDS[*]}" "sim:${SIM_PIDS[*]}" -- "$@"
  fi
  [ -n "${SKIP_PEERS:-}" ] && return 0
  run "$name" nginx http://127.0.0.1:21180 "nginx:${NGINX_PIDS[*]}" "sim:${SIM_PIDS[*]}" -- "$@"
  run "$name" vllm-router http://127.0.0.1:21280 "vllm-router:$VR_PID" "sim:${SIM_PIDS[*]}" -- "$@"
}

scenario_peers() { # label sim-args... -- round body
  :
}

if [ "$SCENARIO" = one-conn ] || [ "$SCENARIO" = all ]; then
  echo "== one-conn: closed loop, 1 connection, non-streaming, zero-delay sim"
  MODELS="bench-model"; start_sims --output-tokens 16; start_hivenet 1; start_hivenet_before 1; start_nginx; start_vllm_router
  for r in $(seq 1 "$ROUNDS"); do
    peers "one-conn-r$r" --connections 1 --duration "$DUR" --model bench-model --max-tokens 16
  done
  [ -z "${SKIP_PEERS:-}" ] && nginx -c "$WORK/nginx.conf" -p "$WORK" -s stop; stop_all; SIM_PIDS=()
fi

if [ "$SCENARIO" = sixteen ] || [ "$SCENARIO" = all ]; then
  echo "== sixteen: closed loop, 16 connections, non-streaming, zero-delay sim"
  MODELS="bench-model"; start_sims --output-tokens 16; start_hivenet 1; start_hivenet_before 1; start_nginx; start_vllm_router
  for r in $(seq 1 "$ROUNDS"); do
    peers "sixteen-r$r" --connections 16 --duration "$DUR" --model bench-model --max-tokens 16
  done
  [ -z "${SKIP_PEERS:-}" ] && nginx -c "$WORK/nginx.conf" -p "$WORK" -s stop; stop_all; SIM_PIDS=()
fi

if [ "$SCENARIO" = first-event ] || [ "$SCENARIO" = all ]; then
  echo "== first-event: one keep-alive connection, streams of 10 events 20 ms apart (time to the first event)"
  MODELS="bench-model"; start_sims --ttft 0ms --itl 20ms --output-tokens 10; start_hivenet 1; start_hivenet_before 1; start_nginx; start_vllm_router
  for r in $(seq 1 "$ROUNDS"); do
    peers "first-event-r$r" --connections 1 --duration "$DUR" --model bench-model --stream --max-tokens 10
  done
  [ -z "${SKIP_PEERS:-}" ] && nginx -c "$WORK/nginx.conf" -p "$WORK" -s stop; stop_all; SIM_PIDS=()
fi

if [ "$SCENARIO" = open ] || [ "$SCENARIO" = all ]; then
  echo "== open: open loop (Poisson), non-streaming, zero-delay sim, rising rates"
  MODELS="bench-model"; start_sims --output-tokens 16 --threads 1; start_hivenet 1; start_hivenet_before 1; start_nginx; start_vllm_router
  for rate in ${RATES:-1000 3000 6000}; do
    for r in $(seq 1 "$ROUNDS"); do
      peers "open-$rate-r$r" --rate "$rate" --duration "$DUR" --model bench-model --max-tokens 16 --timeout 10s
    done
  done
  [ -z "${SKIP_PEERS:-}" ] && nginx -c "$WORK/nginx.conf" -p "$WORK" -s stop; stop_all; SIM_PIDS=()
fi

if [ "$SCENARIO" = stream ] || [ "$SCENARIO" = all ]; then
  echo "== stream: open loop, streaming, sim with ttft 20ms and a 5ms inter-token gap"
  MODELS="bench-model"; start_sims --ttft 20ms --itl 5ms --output-tokens 32; start_hivenet 1; start_nginx; start_vllm_router
  for rate in ${STREAM_RATES:-50 200 400}; do
    for r in $(seq 1 "$ROUNDS"); do
      peers "stream-$rate-r$r" --rate "$rate" --duration "$DUR" --model bench-model --stream --max-tokens 32 --timeout 20s
    done
  done
  [ -z "${SKIP_PEERS:-}" ] && nginx -c "$WORK/nginx.conf" -p "$WORK" -s stop; stop_all; SIM_PIDS=()
fi

if [ "$SCENARIO" = shards ] || [ "$SCENARIO" = all ]; then
  echo "== shards: two models, closed loop 64 connections, router with 1 then 2 shards"
  MODELS="model-a model-b"; start_sims --output-tokens 16
  for r in $(seq 1 "$ROUNDS"); do
    for n in 1 2; do
      start_hivenet "$n"
      run "shards-r$r" "hivenet-$n-shard" http://127.0.0.1:21080 "router:$ROUTER_PID" "agent:${AGENT_PIDS[*]}" "sim:${SIM_PIDS[*]}" -- \
        --connections 64 --duration "$DUR" --model model-a,model-b --max-tokens 16
      kill "$ROUTER_PID" "${AGENT_PIDS[@]}" 2>/dev/null || true; wait "$ROUTER_PID" "${AGENT_PIDS[@]}" 2>/dev/null || true
    done
  done
  stop_all; SIM_PIDS=()
fi

python3 scripts/bench/summary.py "$OUT" >"$OUT/summary.md"
# Logs stay out of the repository: keep the last lines of each as an excerpt.
for f in "$WORK"/*.log; do [ -s "$f" ] && { echo "== $(basename "$f")"; tail -n 5 "$f"; }; done >"$OUT/log-excerpts.txt" 2>/dev/null || true
cat "$OUT/summary.md"
echo "written to $OUT"
