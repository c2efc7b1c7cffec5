#!/usr/bin/env bash
# Cache affinity on simulated engines (issue 30): prefix-aware against
# least-loaded, side by side, on the calibrated hivenet-sim (the prefix
# cache and timings of llama-server, perf/2026-12-02-sim-calibration),
# N agents each (--capacity 4), a load ramp of open-loop multi-turn
# conversations (many applications sharing system prompts, many users
# with growing histories), from light load to past least-loaded's
# saturation. Per step: asked and served rate, time to the first content
# token (p50, p95), errors, and the cached share of prompt tokens from the
# engines' own usage (the router's hivenet_agent_cached_prompt_tokens_total
# / hivenet_agent_prompt_tokens_total, deltas per step).
# The oracle (the issue's "oracle that knows every engine's cache"): the
# same request sequence (same seeds, rates, durations) over the same
# fleet (N sims, the same flags, 4 slots each), each request sent
# straight to the sim with a free slot whose cache holds the longest
# prefix of it; hivenet-bench --oracle-of mirrors every sim's cache
# exactly (it prints the cached tokens it predicted, which equal the sims'
# own count). IDEAL=1 also runs the old upper bound: one sim whose cache
# never evicts (more than any routing over evicting caches can reach).
# BANDS="0.5" also runs prefix-aware with these load bands beside its
# default (1), as strategies prefix-aware-b0.5 and so on.
# HOLDER_WAITS="1000 3000" also runs prefix-aware with these
# holder_wait_ms (wait for a full cache holder), as prefix-aware-w1000 ...
# ORACLE=0 skips the oracle (its column then reads 0 %).
# PEERS="vllm-router:cache_aware vllm-router:round_robin sglang-router:cache_aware"
# (the default; PEERS="" for none) runs the peer routers, installed from
# PyPI at pinned versions into a cache outside the clone, in front of the
# same sims (no agents: they talk to the engines), their cached share from
# the sims' own counters as the oracle's.
# CAPACITY=4: each hivenet agent's --capacity; with a GPU-shaped sim give
# the sims the same --max-running (their slots) in SIM_FLAGS.
# Each engine's requests served are in OUT/reports/*-N-engines.txt (the
# whole ramp) and *-N-STEP-engines.txt (each step); the summary's "busiest
# engine" column is the busiest one's share of each step.
# STRATEGIES="prefix-aware" runs only these of hivenet's strategies
# (default "least-loaded prefix-aware"; with PEERS="" ORACLE=0 it re-runs
# hivenet's rows of an earlier run on a new build: their tokens.txt lines
# and reports replace that run's).
# ONLY_ORACLE=1 runs the oracle alone (to add it to an earlier run: its
# tokens.txt lines and reports go beside that run's).
# Writes OUT/summary.md.
# Usage: AGENTS="8 32" RAMP="0.5 1 2 4" DUR=30s scripts/bench/affinity-ramp.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
AGENTS="${AGENTS:-8 32}"; RAMP="${RAMP:-0.5 1 2 4}"; DUR="${DUR:-30s}"
CONV_PER_AGENT="${CONV_PER_AGENT:-4}"
CAPACITY="${CAPACITY:-4}"
PEERS="${PEERS-vllm-router:cache_aware vllm-router:round_robin sglang-router:cache_aware}"
VLLM_ROUTER_VERSION=0.1.17
SGLANG_ROUTER_VERSION=0.3.2
PEER_VENV="${HIVENET_CACHE:-$HOME/.cache/hivenet}/peer-routers-vllm$VLLM_ROUTER_VERSION-sglang$SGLANG_ROUTER_VERSION"
if [ -n "$PEERS" ] && [ ! -f "$PEER_VENV/.installed" ]; then
  rm -rf "$PEER_VENV"; python3 -m venv "$PEER_VENV"
  "$PEER_VENV/bin/pip" install -q --disable-pip-version-check "vllm-router==$VLLM_ROUTER_VERSION" "sglang-router==$SGLANG_ROUTER_VERSION"
  touch "$PEER_VENV/.installed"
fi
BANDS="${BANDS:-}"
HOLDER_WAITS="${HOLDER_WAITS:-}"
SIM_FLAGS="${SIM_FLAGS:---ttft 5ms --prefill-per-token 9.65ms --itl 30.8ms --output-tokens 16 --prefix-cache-tokens 4096 --cache-block-tokens 1 --bytes-per-token 2.0}"
# The oracle mirrors the sims' caches and slots: their shape from SIM_FLAGS
# (the sim's defaults where a flag is absent) and CAPACITY.
flag_of() { echo " $SIM_FLAGS " | sed -n "s/.* $1 \([^ ]*\) .*/\1/p"; }
ORACLE_SHAPE="${ORACLE_SHAPE:-$(flag_of --prefix-cache-tokens):$(flag_of --cache-block-tokens):$(flag_of --bytes-per-token):$CAPACITY:$(flag_of --cache-eviction)}"
ORACLE_SHAPE="$(echo "$ORACLE_SHAPE" | awk -F: '{printf "%s:%s:%s:%s:%s", ($1==""?0:$1), ($2==""?16:$2), ($3==""?4.0:$3), $4, ($5==""?"prompt-order":$5)}')"
BENCH_FLAGS_SET="${BENCH_FLAGS:+1}"
BENCH_FLAGS="${BENCH_FLAGS:---apps 8 --system-tokens 256 --turns 8 --prompt-tokens 8-16 --max-tokens 16}"
OUT="${OUT:-perf/$(date -u +%Y-%m-%d)-affinity-sim}"
[ -n "${HN_BIN:-}" ] || { cargo build -q --release --workspace --bins; HN_BIN="$PWD/target/release"; }
. scripts/lib.sh
mkdir -p "$OUT/reports"
# A re-run of some rows (STRATEGIES, ONLY_ORACLE) keeps the other rows'
# lines; run_steps replaces the lines of each strategy it runs.
[ -n "${STRATEGIES:-}" ] || [ "${ONLY_ORACLE:-0}" = 1 ] || rm -f "$OUT/reports/tokens.txt"
POLICY="$(mktemp -t prefix-aware-XXXX.yaml)"
printf 'routing_policy:\n  strategy: prefix-aware\n' >"$POLICY"
{
  echo "date: $(date -u +%FT%TZ)"; echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (dirty)')"
  echo "nproc: $(nproc)"; echo "kernel: $(uname -r)"; echo "rustc: $(rustc --version)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
  echo "sim: $SIM_FLAGS"
  echo "bench: $BENCH_FLAGS --conversations (agents x $CONV_PER_AGENT) --stream --rate (agents x step) --duration $DUR --seed (step)"
  echo "prefix-aware policy: defaults (load_band 1 since 2026-12-06, 0.5 before, ttl_seconds 600, block_bytes 2048, holder_wait_ms 3000 bounded by the learned miss cost, since 0aabf7c; 0 before)"
} >"$OUT/env.txt"
echo "SIM_FLAGS=\"$SIM_FLAGS\" CAPACITY=$CAPACITY PEERS=\"$PEERS\" ${ORACLE:+ORACLE=$ORACLE }${STRATEGIES:+STRATEGIES=\"$STRATEGIES\" }${IDEAL:+IDEAL=$IDEAL }${BANDS:+BANDS=\"$BANDS\" }${HOLDER_WAITS:+HOLDER_WAITS=\"$HOLDER_WAITS\" }${BENCH_FLAGS_SET:+BENCH_FLAGS=\"$BENCH_FLAGS\" }AGENTS=\"$AGENTS\" RAMP=\"$RAMP\" DUR=$DUR CONV_PER_AGENT=$CONV_PER_AGENT scripts/bench/affinity-ramp.sh" >"$OUT/cmd.txt"
export HIVENET_ROUTER_ADMIN_API_KEYS=bench-admin
metric_sum() {
  curl -sf "http://127.0.0.1:$MET/metrics" | awk -v n="$1" 'index($0, n "{") == 1 {s += $NF} END {printf "%.0f", s}'
}
# The sim's own prefix-cache counters (tokens asked, tokens found).
sim_counter() {
  curl -sf "$1/metrics" | awk -v n="vllm:prefix_cache_$2_total" 'index($0, n "{") == 1 {printf "%.0f", $NF}'
}
# The same counters summed over the fleet of the oracle run ($SIM_URLS).
sims_counter() {
  local u total=0
  for u in ${SIM_URLS//,/ }; do total=$((total + $(sim_counter "$u" "$1"))); done
  echo "$total"
}
# Requests each sim of $SIM_URLS served so far, space-separated.
engines_served() {
  local u
  for u in ${SIM_URLS//,/ }; do
    curl -sf "$u/metrics" | awk 'index($0, "vllm:request_success_total{") == 1 {s += $NF} END {printf "%.0f ", s}'
  done
}
# N sims of SIM_FLAGS, up; their URLs in SIM_URLS (no agents).
start_sims() {
  local i port u
  SIM_URLS=""
  for i in $(seq 1 "$1"); do
    port=$(hn_free_port)
    # shellcheck disable=SC2086
    hn_sim "$port" sim-model "sim-$i" $SIM_FLAGS
    SIM_URLS="$SIM_URLS${SIM_URLS:+,}http://127.0.0.1:$port"
  done
  for u in ${SIM_URLS//,/ }; do hn_wait_http "$u/v1/models" 20; done
}
run_steps() { # strategy n url [router]
  local strategy="$1" n="$2" url="$3" step=0
  [ ! -f "$OUT/reports/tokens.txt" ] || sed -i "/^$strategy $n /d" "$OUT/reports/tokens.txt"
  for r in $RAMP; do
    step=$((step + 1))
    local rate p0=0 c0=0
    rate=$(python3 -c "print($n * $r)")
    if [ "$strategy" = ideal ]; then
      p0=$(sim_counter "$url" queries); c0=$(sim_counter "$url" hits)
    elif [ "$strategy" = oracle ] || [ -n "${PEER:-}" ]; then
      p0=$(sims_counter queries); c0=$(sims_counter hits)
    else
      p0=$(metric_sum hivenet_agent_prompt_tokens_total); c0=$(metric_sum hivenet_agent_cached_prompt_tokens_total)
    fi
    # Each engine's requests before the step (the step's share below).
    local e0=""
    [ "$strategy" = ideal ] || e0=$(engines_served)
    # shellcheck disable=SC2086
    local target=(--url "$url")
    [ "$strategy" = oracle ] && target=(--url "${SIM_URLS%%,*}" --oracle-of "$SIM_URLS" --oracle-shape "$ORACLE_SHAPE" --oracle-state "$HN_WORK/oracle-state.json")
    "$HN_BIN/hivenet-bench" "${target[@]}" --model sim-model --stream --rate "$rate" --seed "$step" \
      --duration "$DUR" --timeout 60s --quiet $BENCH_FLAGS --conversations $((n * CONV_PER_AGENT)) \
      --out "$OUT/reports/$strategy-$n-$step.json" >"$OUT/reports/$strategy-$n-$step.txt" 2>&1 || true
    if [ "$strategy" = ideal ]; then
      echo "$strategy $n $step $r $(( $(sim_counter "$url" queries) - p0 )) $(( $(sim_counter "$url" hits) - c0 ))" >>"$OUT/reports/tokens.txt"
    elif [ "$strategy" = oracle ] || [ -n "${PEER:-}" ]; then
      echo "$strategy $n $step $r $(( $(sims_counter queries) - p0 )) $(( $(sims_counter hits) - c0 ))" >>"$OUT/reports/tokens.txt"
    else
      sleep 1
      echo "$strategy $n $step $r $(( $(metric_sum hivenet_agent_prompt_tokens_total) - p0 )) $(( $(metric_sum hivenet_agent_cached_prompt_tokens_total) - c0 ))" >>"$OUT/reports/tokens.txt"
    fi
    if [ -n "$e0" ]; then
      paste -d' ' <(echo "$e0" | tr ' ' '\n' | grep .) <(engines_served | tr ' ' '\n' | grep .) |
        awk '{printf "%d ", $2 - $1} END {print ""}' >"$OUT/reports/$strategy-$n-$step-engines.txt"
    fi
  done
}
for n in $AGENTS; do
  for strategy in $([ "${ONLY_ORACLE:-0}" = 1 ] || echo "${STRATEGIES:-least-loaded prefix-aware}") $(for b in $BANDS; do echo "prefix-aware-b$b"; done) $(for w in $HOLDER_WAITS; do echo "prefix-aware-w$w"; done); do
    HN_WORK="$(mktemp -d -t hivenet-aff-XXXX)"; HN_PIDS=()
    HTTP=$(hn_free_port); MET=$(hn_free_port); P2P=$(hn_free_port)
    args=(--disk-db-path "$HN_WORK/db")
    case "$strategy" in
      prefix-aware) args+=(--policy-file "$POLICY") ;;
      prefix-aware-b*)
        printf 'routing_policy:\n  strategy: prefix-aware\n  affinity:\n    load_band: %s\n' "${strategy#prefix-aware-b}" >"$HN_WORK/band.yaml"
        args+=(--policy-file "$HN_WORK/band.yaml") ;;
      prefix-aware-w*)
        printf 'routing_policy:\n  strategy: prefix-aware\n  affinity:\n    holder_wait_ms: %s\n' "${strategy#prefix-aware-w}" >"$HN_WORK/wait.yaml"
        args+=(--policy-file "$HN_WORK/wait.yaml") ;;
    esac
    hn_router "$HTTP" "$MET" "$P2P" "${args[@]}"
    SIM_URLS=""
    for i in $(seq 1 "$n"); do
      port=$(hn_free_port)
      # shellcheck disable=SC2086
      hn_sim "$port" sim-model "sim-$i" $SIM_FLAGS
      SIM_URLS="$SIM_URLS${SIM_URLS:+,}http://127.0.0.1:$port"
      hn_agent "$P2P" "$port" "a$i.key" "agent-$i" --capacity "$CAPACITY" --warmup off
    done
    hn_wait_http "http://127.0.0.1:$HTTP/v1/models" 120 "\"healthy\":$n"
    run_steps "$strategy" "$n" "http://127.0.0.1:$HTTP"
    engines_served >"$OUT/reports/$strategy-$n-engines.txt"
    curl -sf "http://127.0.0.1:$MET/metrics" | grep '^hivenet_affinity' >"$OUT/reports/$strategy-$n-affinity.txt" || true
    hn_stop_all
    rm -rf "$HN_WORK"
  done
  # The peers, in front of the same sims (no agents: they call the engines).
  for peer in $([ "${ONLY_ORACLE:-0}" = 1 ] || echo "$PEERS"); do
    HN_WORK="$(mktemp -d -t hivenet-peer-XXXX)"; HN_PIDS=()
    start_sims "$n"
    PP=$(hn_free_port); PM=$(hn_free_port)
    name="${peer%%:*}"; policy="${peer#*:}"
    # shellcheck disable=SC2086
    case "$name" in
      vllm-router) "$PEER_VENV/bin/vllm-router" --host 127.0.0.1 --port "$PP" --worker-urls ${SIM_URLS//,/ } \
        --policy "$policy" --log-level warning --prometheus-port "$PM" >"$HN_WORK/peer.log" 2>&1 & ;;
      sglang-router) "$PEER_VENV/bin/python" -m sglang_router.launch_router --host 127.0.0.1 --port "$PP" \
        --worker-urls ${SIM_URLS//,/ } --policy "$policy" --log-level warn --prometheus-port "$PM" >"$HN_WORK/peer.log" 2>&1 & ;;
      *) echo "unknown peer $name" >&2; exit 2 ;;
    esac
    HN_PIDS+=("$!")
    hn_wait_http "http://127.0.0.1:$PP/v1/models" 120 || { tail -20 "$HN_WORK/peer.log" >&2; exit 1; }
    PEER=1 run_steps "$name-$policy" "$n" "http://127.0.0.1:$PP"
    engines_served >"$OUT/reports/$name-$policy-$n-engines.txt"
    hn_stop_all
    rm -rf "$HN_WORK"
  done
  # The oracle: the same fleet of sims, every cache known.
  [ "${ORACLE:-1}" = 0 ] && continue
  HN_WORK="$(mktemp -d -t hivenet-oracle-XXXX)"; HN_PIDS=()
  start_sims "$n"
  run_steps oracle "$n" ""
  hn_stop_all
  rm -rf "$HN_WORK"
  if [ "${IDEAL:-0}" = 1 ]; then
    # The old upper bound: one sim, a cache that never evicts, no waiting.
    HN_WORK="$(mktemp -d -t hivenet-ideal-XXXX)"; HN_PIDS=()
    port=$(hn_free_port)
    hn_sim "$port" sim-model ideal --prefix-cache-tokens 1000000000 --cache-block-tokens 1 --bytes-per-token 2.0 --output-tokens 16 --threads 2
    hn_wait_http "http://127.0.0.1:$port/v1/models" 20
    run_steps ideal "$n" "http://127.0.0.1:$port"
    hn_stop_all
    rm -rf "$HN_WORK"
  fi
done
rm -f "$POLICY" "$OUT"/reports/*.svg
python3 scripts/bench/affinity-summary.py "$OUT" | tee "$OUT/summary.md"
rm -rf "$OUT/reports"/*.txt.gz
