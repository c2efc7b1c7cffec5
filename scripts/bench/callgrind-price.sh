#!/usr/bin/env bash
# Instructions per request of the router, one configuration against
# another, by callgrind (deterministic, unlike CPU time on a shared
# machine): (Ir after 2500 requests - Ir after 500) / 2000, one
# connection, epoll driver (valgrind does not run io_uring).
#
# usage: OFF_ARGS="..." ON_ARGS="..." [KEY=bearer] [BODY=json] scripts/bench/callgrind-price.sh
#   (scripts/bench/callgrind-auth.sh and scripts/bench/callgrind-admission.sh set them)
set -euo pipefail
cd "$(dirname "$0")/../.."
command -v valgrind >/dev/null || { apt-get update -qq && apt-get install -y -qq valgrind >/dev/null; }
cargo build -q --release --workspace --bins
B="$PWD/target/release"
W=${WORKDIR:-$(mktemp -d)}
BODY=${BODY:-'{"model":"m","max_tokens":16,"messages":[{"role":"user","content":"hello there"}]}'}
$B/hivenet-sim --port 23881 --model m > $W/sim.log 2>&1 & SIM=$!
trap 'kill $SIM 2>/dev/null || true' EXIT
sleep 0.5
run() { # label args n
  local label=$1 args=$2 n=$3
  HIVENET_ROUTER_ADMIN_API_KEYS=adm valgrind --tool=callgrind --callgrind-out-file=$W/cg-$label-$n.out \
    $B/hivenet-router --shards 1 --driver epoll --http-port 127.0.0.1:23080 --metrics-port 127.0.0.1:23112 --p2p-port 23900 \
    --disk-db-path $W/db-$label-$n --identity-path $W/r.key $args > $W/router-$label-$n.log 2>&1 & local R=$!
  for _ in $(seq 1 600); do curl -sf 127.0.0.1:23080/health >/dev/null && break; sleep 0.1; done
  $B/hivenet-agent --router-p2p /ip4/127.0.0.1/tcp/23900 --backend-url http://127.0.0.1:23881 --identity-path $W/a.key > $W/agent-$label-$n.log 2>&1 & local A=$!
  for _ in $(seq 1 600); do curl -sf -H "Authorization: Bearer adm" 127.0.0.1:23080/admin/models | grep -q '"m"' && break; sleep 0.1; done
  python3 - $n "${KEY:-}" "$BODY" <<'PY'
import http.client, sys
n, key, body = int(sys.argv[1]), sys.argv[2], sys.argv[3]
h = {"Content-Type": "application/json"}
if key:
    h["Authorization"] = "Bearer " + key
c = http.client.HTTPConnection("127.0.0.1", 23080)
for i in range(n):
    c.request("POST", "/v1/chat/completions", body, h)
    r = c.getresponse(); r.read()
    assert r.status == 200, r.status
PY
  kill $A; wait $A 2>/dev/null || true
  kill -TERM $R; wait $R 2>/dev/null || true
  local ir=$(grep -m1 "^summary:" $W/cg-$label-$n.out | awk '{print $2}')
  echo "$label $n $ir"
}
for label in off on; do
  args="${OFF_ARGS:-}"; [ $label = on ] && args="${ON_ARGS:-}"
  a=$(run $label "$args" 500); b=$(run $label "$args" 2500)
  echo "$a"; echo "$b"
  ia=$(echo $a | awk '{print $3}'); ib=$(echo $b | awk '{print $3}')
  echo "$label: $(( (ib - ia) / 2000 )) instructions/request"
done
echo "callgrind files in $W (callgrind_annotate --inclusive=yes <file>)"
