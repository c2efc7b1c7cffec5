#!/usr/bin/env bash
# The main job on a real engine: a router, two llama-servers (SmolLM2-135M,
# one thread each, built and cached by scripts/install-llama.sh) and their
# agents; a short multi-turn chat streamed to the terminal; then, per
# agent, the requests served, SRTT and the share of prompt tokens the
# engine read from its prefix cache. scripts/demo.sh is the fast default
# on the simulator.
set -euo pipefail
export HIVENET_ROUTER_ADMIN_API_KEYS="demo-admin-$(date +%s%N)"
cd "$(dirname "$0")/.."
cargo build -q --workspace --bins
. scripts/lib.sh
eval "$(scripts/install-llama.sh)"
HN_BIN="target/debug"
HN_WORK="$(mktemp -d -t hivenet-demo-real-XXXX)"
cleanup() { hn_stop_all; echo "== stopped ${#HN_PIDS[@]} processes; logs in $HN_WORK"; }
trap cleanup EXIT
HTTP=$(hn_free_port); METRICS=$(hn_free_port); P2P=$(hn_free_port)
L1=$(hn_free_port); L2=$(hn_free_port)
echo "== two llama-servers (alias smollm), router, two agents"
for p in $L1 $L2; do
  "$LLAMA_SERVER" -m "$LLAMA_MODEL" --alias smollm --host 127.0.0.1 --port "$p" -t 1 -c 2048 -np 1 --metrics \
    >"$HN_WORK/llama-$p.log" 2>&1 &
  HN_PIDS+=($!)
done
for p in $L1 $L2; do hn_wait_http "http://127.0.0.1:$p/health" 120; done
hn_router "$HTTP" "$METRICS" "$P2P" --disk-db-path "$HN_WORK/db"
hn_agent "$P2P" "$L1" agent1.key agent1 --engine llamacpp --machine llama-1
hn_agent "$P2P" "$L2" agent2.key agent2 --engine llamacpp --machine llama-2
hn_wait_http "http://127.0.0.1:$HTTP/v1/models" 60 '"healthy":2'
python3 - "$HTTP" "$HIVENET_ROUTER_ADMIN_API_KEYS" <<'PY'
import json, sys, urllib.request
http, admin = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{http}"
messages = [{"role": "system", "content": "You are a helpful, terse assistant. " * 8}]
for turn in ["What is a router?", "Name one colour.", "And another one?"]:
    messages.append({"role": "user", "content": turn})
    body = json.dumps({"model": "smollm", "stream": True, "temperature": 0, "max_tokens": 40,
                       "stream_options": {"include_usage": True}, "messages": messages}).encode()
    req = urllib.request.Request(f"{base}/v1/chat/completions", body, {"Content-Type": "application/json"})
    print(f"== user: {turn}\n   assistant: ", end="", flush=True)
    text = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for c in ev.get("choices", []):
                piece = (c.get("delta") or {}).get("content") or ""
                text.append(piece)
                print(piece, end="", flush=True)
            if ev.get("usage"):
                u = ev["usage"]
                cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                print(f"\n   [prompt {u['prompt_tokens']} tokens, {cached} from the engine's cache]", end="")
    print()
    messages.append({"role": "assistant", "content": "".join(text)})
req = urllib.request.Request(f"{base}/admin/routing-table", headers={"Authorization": f"Bearer {admin}"})
table = json.load(urllib.request.urlopen(req, timeout=5))
print("== per agent (GET /admin/routing-table)")
for a in table["agents"]:
    u = a["universal"]
    inp, cached = u.get("input_tokens_total", 0), u.get("cached_prompt_tokens_total", 0)
    ratio = f"{cached / inp:.0%}" if inp else "-"
    srtt = u["srtt_ms"] and round(u["srtt_ms"], 1)
    print(f"   {a['metadata'].get('machine', '')} {a['peer_id'][:16]}: served {u['successful_requests_total']}, "
          f"{u['latency_state']} srtt {srtt} ms, prompt tokens {inp} of which cached {cached} ({ratio})")
PY
