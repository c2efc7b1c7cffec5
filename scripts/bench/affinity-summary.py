"""Summary table of scripts/bench/affinity-ramp.sh: per fleet size and load
step, least-loaded and prefix-aware side by side, and the cached share of
the same request sequence through the oracle that knows every engine's
cache (same fleet), and, when run (IDEAL=1), through one cache that never
evicts."""
import json, os, sys

out = sys.argv[1]
rows = {}
for line in open(f"{out}/reports/tokens.txt"):
    strategy, n, step, r, prompt, cached = line.split()
    rows[(strategy, int(n), int(step))] = (float(r), int(prompt), int(cached))


def report(strategy, n, step):
    p = f"{out}/reports/{strategy}-{n}-{step}.json"
    return json.load(open(p)) if os.path.exists(p) else {}


# least-loaded, prefix-aware at its default band, then at the BANDS asked.
strategies = ["least-loaded", "prefix-aware"] + sorted(
    {k[0] for k in rows if k[0].startswith("prefix-aware-b")}, key=lambda s: float(s[len("prefix-aware-b"):])) + sorted(
    {k[0] for k in rows if k[0].startswith("prefix-aware-w")}, key=lambda s: int(s[len("prefix-aware-w"):])) + sorted(
    {k[0] for k in rows if k[0].startswith(("vllm-router-", "sglang-router-"))})


def busiest(strategy, n, step):
    """The busiest engine's share of the requests the fleet served in the
    step (1/n: even; 1: all on one); runs before the per-step counts have
    the whole ramp's, on the first step."""
    p = f"{out}/reports/{strategy}-{n}-{step}-engines.txt"
    if not os.path.exists(p):
        p = f"{out}/reports/{strategy}-{n}-engines.txt" if step == 1 else ""
    if not p or not os.path.exists(p):
        return ""
    counts = [int(x) for x in open(p).read().split()]
    return f"{max(counts) / sum(counts):.0%}" if counts and sum(counts) else ""


def share(key):
    _, prompt, cached = rows.get(key, (0, 0, 0))
    return cached / prompt if prompt else 0.0


print("# Cache affinity on calibrated simulated engines: prefix-aware vs least-loaded\n")
print("| agents | asked /s | strategy | served /s | errors | first content p50 / p95 / p99 ms | latency p50 / p95 / p99 ms | cached share | of the oracle's | busiest engine (step, or the whole ramp where a run kept no per-step counts) |")
print("|---|---|---|---|---|---|---|---|---|---|")
for n in sorted({k[1] for k in rows}):
    for step in sorted({k[2] for k in rows if k[1] == n}):
        oracle = share(("oracle", n, step))
        for strategy in strategies:
            if (strategy, n, step) not in rows:
                continue
            r = rows[(strategy, n, step)][0]
            j = report(strategy, n, step)
            fc = j.get("first_content") or {}
            s = share((strategy, n, step))
            lat = j.get("total") or {}
            print(f"| {n} | {n * r:g} | {strategy} | {j.get('achieved_rps', 0):.1f} | {j.get('errors', 0)} | "
                  f"{fc.get('p50', 0):.0f} / {fc.get('p95', fc.get('p90', 0)):.0f} / {fc.get('p99', 0):.0f} | "
                  f"{lat.get('p50', 0):.0f} / {lat.get('p95', 0):.0f} / {lat.get('p99', 0):.0f} | {s:.1%} | "
                  f"{(s / oracle if oracle else 0):.0%} | {busiest(strategy, n, step)} |")
        if ("oracle", n, step) not in rows:
            continue
        j = report("oracle", n, step)
        fc = j.get("first_content") or {}
        print(f"| {n} | | oracle (every engine's cache known, same fleet and requests) | {j.get('achieved_rps', 0):.1f} | "
              f"{j.get('errors', 0)} | {fc.get('p50', 0):.0f} / {fc.get('p95', fc.get('p90', 0)):.0f} | | {oracle:.1%} | 100% | |")
        # The oracle's mirrors against the sims' own count of cached tokens.
        t = f"{out}/reports/oracle-{n}-{step}.txt"
        pred = [l.split()[-1] for l in open(t) if l.startswith("oracle: cached tokens predicted")] if os.path.exists(t) else []
        if pred and ("oracle", n, step) in rows:
            sims = rows[("oracle", n, step)][2]
            mark = "exact" if int(pred[0]) == sims else f"MISMATCH: sims {sims}"
            print(f"| {n} | | (oracle's mirrors predicted {int(pred[0]):,} cached tokens: {mark}) | | | | | | | |")
        if ("ideal", n, step) in rows:
            ideal = share(("ideal", n, step))
            print(f"| {n} | | ideal (one never-evicting cache, same requests) | | | | | {ideal:.1%} | "
                  f"{(ideal / oracle if oracle else 0):.0%} | |")
