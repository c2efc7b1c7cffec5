#!/usr/bin/env bash
# Time to the first streamed event on the real engine (issue 27): one
# llama-server (SmolLM2-135M, one thread), asked directly and through
# router + agent, one connection, rounds interleaved (direct, hivenet,
# direct, ...), the same short prompt each time (its prefix is cached
# after the first request, as in a conversation). Writes OUT/summary.md.
# Usage: ROUNDS=3 DUR=15s scripts/bench/real-first-token.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS="${ROUNDS:-3}"; DUR="${DUR:-15s}"
OUT="${OUT:-perf/$(date -u +%Y-%m-%d)-real-first-token}"
cargo build -q --release --workspace --bins
. scripts/lib.sh
eval "$(scripts/install-llama.sh)"
HN_BIN="$PWD/target/release"
HN_WORK="$(mktemp -d -t hivenet-real-XXXX)"
trap hn_stop_all EXIT
mkdir -p "$OUT/reports"
L=$(hn_free_port); HTTP=$(hn_free_port); MET=$(hn_free_port); P2P=$(hn_free_port)
"$LLAMA_SERVER" -m "$LLAMA_MODEL" --host 127.0.0.1 --port "$L" -t 1 -c 2048 -np 1 --metrics >"$HN_WORK/llama.log" 2>&1 &
HN_PIDS+=($!)
hn_wait_http "http://127.0.0.1:$L/health" 120
export HIVENET_ROUTER_ADMIN_API_KEYS=bench-admin
hn_router "$HTTP" "$MET" "$P2P" --disk-db-path "$HN_WORK/db"
hn_agent "$P2P" "$L" agent.key agent --engine llamacpp --warmup off
hn_wait_http "http://127.0.0.1:$HTTP/v1/models" 60 '"healthy":1'
{
  echo "date: $(date -u +%FT%TZ)"; echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (dirty)')"
  echo "nproc: $(nproc)"; echo "kernel: $(uname -r)"; echo "rustc: $(rustc --version)"
  echo "engine: $LLAMA_SERVER (-t 1 -c 2048 -np 1)"; echo "model: $LLAMA_MODEL"
} >"$OUT/env.txt"
echo "ROUNDS=$ROUNDS DUR=$DUR scripts/bench/real-first-token.sh" >"$OUT/cmd.txt"
MODEL="$LLAMA_MODEL"
for r in $(seq 1 "$ROUNDS"); do
  for t in direct hivenet; do
    url="http://127.0.0.1:$L"; [ "$t" = hivenet ] && url="http://127.0.0.1:$HTTP"
    "$HN_BIN/hivenet-bench" --url "$url" --connections 1 --duration "$DUR" --model "$MODEL" \
      --stream --prompt-tokens 32 --max-tokens 8 --timeout 60s --out "$OUT/reports/r$r-$t.json" \
      >"$OUT/reports/r$r-$t.txt" 2>&1
  done
done
rm -f "$OUT"/reports/*.svg
python3 - "$OUT" "$ROUNDS" <<'PY'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def p(report, *keys):
    for k in keys:
        report = report.get(k, {}) if isinstance(report, dict) else {}
    return report
rows = ["| round | target | ok | first event p50 ms | first event p90 ms | total p50 ms |", "|---|---|---|---|---|---|"]
first = {"direct": [], "hivenet": []}
for r in range(1, rounds + 1):
    for t in ("direct", "hivenet"):
        j = json.load(open(f"{out}/reports/r{r}-{t}.json"))
        fe = j.get("first_event_ms") or j.get("first_event") or {}
        tot = j.get("total_ms") or j.get("total") or {}
        ok = j.get("ok", j.get("successes", "?"))
        f50 = fe.get("p50"); f90 = fe.get("p90"); t50 = tot.get("p50")
        if f50 is not None:
            first[t].append(f50)
        rows.append(f"| r{r} | {t} | {ok} | {f50} | {f90} | {t50} |")
added = [h - d for d, h in zip(first["direct"], first["hivenet"])]
with open(f"{out}/summary.md", "w") as f:
    f.write("# Time to the first event on llama-server, direct vs through router + agent\n\n")
    f.write("\n".join(rows) + "\n\n")
    f.write(f"Added to the first event per round (hivenet p50 - direct p50), ms: {', '.join(f'{a:.2f}' for a in added)}\n")
print(open(f"{out}/summary.md").read())
PY
