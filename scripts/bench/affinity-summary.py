"""Summary table of scripts/bench/affinity-ramp.sh: per fleet size and load
step, least-loaded and prefix-aware side by side, and the oracle's cached
share of the same request sequence."""
import json, os, sys

out = sys.argv[1]
rows = {}
for line in open(f"{out}/reports/tokens.txt"):
    strategy, n, step, r, prompt, cached = line.split()
    rows[(strategy, int(n), int(step))] = (float(r), int(prompt), int(cached))


def report(strategy, n, step):
    p = f"{out}/reports/{strategy}-{n}-{step}.json"
    return json.load(open(p)) if os.path.exists(p) else {}


def share(key):
    _, prompt, cached = rows.get(key, (0, 0, 0))
    return cached / prompt if prompt else 0.0


print("# Cache affinity on calibrated simulated engines: prefix-aware vs least-loaded\n")
print("| agents | asked /s | strategy | served /s | errors | first content p50 / p95 ms | cached share | of the oracle's |")
print("|---|---|---|---|---|---|---|---|")
for n in sorted({k[1] for k in rows}):
    for step in sorted({k[2] for k in rows if k[1] == n}):
        oracle = share(("oracle", n, step))
        for strategy in ("least-loaded", "prefix-aware"):
            if (strategy, n, step) not in rows:
                continue
            r = rows[(strategy, n, step)][0]
            j = report(strategy, n, step)
            fc = j.get("first_content") or {}
            s = share((strategy, n, step))
            print(f"| {n} | {n * r:g} | {strategy} | {j.get('achieved_rps', 0):.1f} | {j.get('errors', 0)} | "
                  f"{fc.get('p50', 0):.0f} / {fc.get('p95', fc.get('p90', 0)):.0f} | {s:.1%} | "
                  f"{(s / oracle if oracle else 0):.0%} |")
        print(f"| {n} | | oracle (one never-evicting cache, same requests) | | | | {oracle:.1%} | 100% |")
