# Shared helpers of the project's shell scripts (demos, benchmarks):
# free ports, processes started and stopped by PID with their logs in
# $HN_WORK, waits for HTTP. Source it: . "$(dirname "$0")/lib.sh"
# (from scripts/bench/: . "$(dirname "$0")/../lib.sh").

HN_PIDS=()

# A port free on 127.0.0.1 now.
hn_free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

# hn_start NAME LOG ARGS...: start binary NAME from $HN_BIN with its output
# in $HN_WORK/LOG.log; its PID joins HN_PIDS (and is in HN_LAST_PID).
hn_start() {
  local name="$1" log="$2"; shift 2
  "$HN_BIN/$name" "$@" >"$HN_WORK/$log.log" 2>&1 &
  HN_LAST_PID=$!
  HN_PIDS+=("$HN_LAST_PID")
}

# hn_router HTTP METRICS P2P [ARGS...]
hn_router() {
  local http="$1" metrics="$2" p2p="$3"; shift 3
  hn_start hivenet-router router --http-port "127.0.0.1:$http" --metrics-port "127.0.0.1:$metrics" \
    --p2p-port "$p2p" "$@"
}

# hn_sim PORT MODEL LOG [ARGS...]
hn_sim() {
  local port="$1" model="$2" log="$3"; shift 3
  hn_start hivenet-sim "$log" --port "$port" --model "$model" "$@"
}

# hn_agent P2P BACKEND_PORT IDENTITY LOG [ARGS...]
hn_agent() {
  local p2p="$1" backend="$2" identity="$3" log="$4"; shift 4
  hn_start hivenet-agent "$log" --router-p2p "/ip4/127.0.0.1/tcp/$p2p" \
    --backend-url "http://127.0.0.1:$backend" --identity-path "$HN_WORK/$identity" "$@"
}

# hn_wait_http URL [SECONDS] [GREP]: wait until URL answers 2xx (and its
# body matches GREP when given); 1 after SECONDS (default 10).
hn_wait_http() {
  local url="$1" limit="${2:-10}" pattern="${3:-}" i
  for i in $(seq 1 $((limit * 10))); do
    if [ -z "$pattern" ]; then
      curl -sf "$url" >/dev/null && return 0
    else
      curl -sf "$url" | grep -q "$pattern" && return 0
    fi
    sleep 0.1
  done
  echo "timed out waiting for $url${pattern:+ to show $pattern}" >&2
  return 1
}

# Stop every process started here, by PID, and wait for them.
hn_stop_all() {
  local p
  for p in "${HN_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${HN_PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
}
