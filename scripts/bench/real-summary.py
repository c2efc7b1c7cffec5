"""Summarise a real-compare folder: per round, each target's p50 of the
first content delta, the content gap and the whole response; the added
time of each proxy against direct in the same round; medians over rounds.
Usage: python3 real-summary.py OUT ROUNDS [TARGET...] (direct first)"""
import json
import statistics
import sys

out, rounds = sys.argv[1], int(sys.argv[2])
TARGETS = tuple(sys.argv[3:]) or ("direct", "hivenet", "vllm-router")
METRICS = (("stream", "first_content"), ("stream", "content_gap"), ("whole", "total"))


errors = {}


def p50(r, t, kind, metric):
    j = json.load(open(f"{out}/reports/r{r}-{t}-{kind}.json"))
    if metric != "content_gap":
        errors.setdefault((t, kind), []).append((j["errors"], j.get("errors_by_status", {})))
    return j[metric]["p50"]


per = {(t, m): [] for t in TARGETS for _, m in METRICS}
for r in range(1, rounds + 1):
    for t in TARGETS:
        for kind, m in METRICS:
            per[(t, m)].append(p50(r, t, kind, m))

med = statistics.median
print("# The real engine side by side: llama-server direct, through hivenet, through vllm-router\n")
print(f"{rounds} interleaved rounds; each value is the median over rounds of a round's p50 (ms).")
print("`added` is the proxy's p50 minus direct's p50 in the same round, then the median over rounds.\n")
others = TARGETS[1:]
print("| metric | " + " | ".join(TARGETS) + " | " + " | ".join(f"{t} added" for t in others) + " | "
      + " | ".join(f"{t} / direct" for t in others) + " |")
print("|---" * (1 + len(TARGETS) + 2 * len(others)) + "|")
for _, m in METRICS:
    d = per[("direct", m)]
    row = [m, f"{med(d):.3f}"]
    row += [f"{med(per[(t, m)]):.3f}" for t in TARGETS[1:]]
    added = {t: med([x - y for x, y in zip(per[(t, m)], d)]) for t in TARGETS[1:]}
    row += [f"{added[t]:+.3f}" for t in TARGETS[1:]]
    row += [f"{med([x / y for x, y in zip(per[(t, m)], d)]):.4f}" for t in TARGETS[1:]]
    print("| " + " | ".join(row) + " |")
print()
fc = {t: [x - y for x, y in zip(per[(t, "first_content")], per[("direct", "first_content")])] for t in TARGETS[1:]}
h, v = med(fc["hivenet"]), med(fc["vllm-router"])
print(f"First content delta, added: hivenet {h:+.3f} ms, vllm-router {v:+.3f} ms; "
      f"target: hivenet <= 0.5 ms and <= half of vllm-router's ({v / 2:+.3f} ms): "
      f"{'met' if h <= 0.5 and h <= v / 2 else 'MISSED'}.")
print("\nFailed requests (of REQS per run), by target and kind: " + "; ".join(
    f"{t} {k}: {sum(n for n, _ in v)}" + (f" (statuses {[s for n, s in v if n]})" if any(n for n, _ in v) else "")
    for (t, k), v in sorted(errors.items())) + ".")
print("\nPer round, first content delta added (ms):\n")
print("| round | " + " | ".join(others) + " |")
print("|---" * (1 + len(others)) + "|")
for i in range(rounds):
    print(f"| r{i + 1} | " + " | ".join(f"{fc[t][i]:+.3f}" for t in others) + " |")
