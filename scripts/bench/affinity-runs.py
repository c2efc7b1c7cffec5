"""Side by side of repeated scripts/bench/affinity-ramp.sh runs (issue 55):
per fleet size, load step and router, each run's served rate, refusals,
p95 latency, p95 time to first token and cached share, with the spread
between the runs (max / min - 1), and each run's cached share against the
oracle's. Then the issue's targets, checked per run: prefix-aware's p95
against the best peer's at every step, its served rate against the best
peer's past saturation (the steps where the best peer serves less than
was asked), and its cached share against the oracle's below saturation.
Last, each engine's share of each step's requests (from the sims' own
counters, *-N-STEP-engines.txt), per router and run.

Usage: python3 scripts/bench/affinity-runs.py RUN_DIR [RUN_DIR ...] > results.md
"""
import json
import os
import sys

RUNS = sys.argv[1:]
PEERS = ("vllm-router-", "sglang-router-")


def load(run):
    rows = {}
    for line in open(f"{run}/reports/tokens.txt"):
        strategy, n, step, r, prompt, cached = line.split()
        j = {}
        p = f"{run}/reports/{strategy}-{n}-{step}.json"
        if os.path.exists(p):
            j = json.load(open(p))
        rows[(strategy, int(n), int(step))] = {
            "asked": int(n) * float(r),
            "served": j.get("achieved_rps", 0.0),
            "errors": j.get("errors", 0),
            "p95": (j.get("total") or {}).get("p95", 0.0),
            "ttft95": (j.get("first_content") or {}).get("p95", 0.0),
            "cached": int(cached) / int(prompt) if int(prompt) else 0.0,
            "ok": j.get("ok", 0),
            "elapsed": j.get("elapsed_s", 0.0),
            "dist": j.get("distribution") or [],
            "engines": engines_of(f"{run}/reports/{strategy}-{n}-{step}-engines.txt"),
        }
    return rows


def engines_of(path):
    """Requests each engine served in the step (empty: not recorded)."""
    if not os.path.exists(path):
        return []
    return [int(v) for v in open(path).read().split()]


def share_within(dist, ms):
    """The share of answered requests whose latency was at most `ms`,
    read off the percentile table by linear interpolation."""
    prev = (0.0, 0.0)
    for pct, v in dist:
        if v >= ms:
            if v == prev[1]:
                return pct / 100
            return (prev[0] + (pct - prev[0]) * (ms - prev[1]) / (v - prev[1])) / 100
        prev = (pct, v)
    return 1.0 if dist else 0.0


def goodput(x, ms):
    """Requests answered within `ms`, per second of the step."""
    return x["ok"] * share_within(x["dist"], ms) / x["elapsed"] if x["elapsed"] else 0.0


def served_at_p95(steps, ms):
    """A router's served rate where its p95 would equal `ms`, linear
    between the steps of its ramp (its p95 grows with the load); its
    highest served rate when `ms` is past its last step's p95."""
    pts = sorted((x["p95"], x["served"]) for x in steps)
    if not pts:
        return 0.0
    if ms <= pts[0][0]:
        return pts[0][1]
    for (p0, s0), (p1, s1) in zip(pts, pts[1:]):
        if p0 <= ms <= p1:
            return s0 + (s1 - s0) * (ms - p0) / (p1 - p0) if p1 > p0 else max(s0, s1)
    return max(s for _, s in pts)


runs = [load(r) for r in RUNS]
keys = sorted({k for r in runs for k in r}, key=lambda k: (k[1], k[2]))
order = ["least-loaded", "prefix-aware"]


def rank(s):
    if s in order:
        return (order.index(s), s)
    if s.startswith("prefix-aware-"):
        return (2, s)
    if s == "oracle":
        return (9, s)
    return (5, s)


def spread(xs):
    xs = [x for x in xs if x > 0]
    return f"{max(xs) / min(xs) - 1:.0%}" if len(xs) > 1 else ""


def both(xs, fmt):
    return ", ".join(fmt(x) for x in xs)


print(f"Runs: {', '.join(RUNS)}. Spread: max / min - 1 over the runs.\n")
print("| engines | asked /s | router | served /s (spread) | refused | p95 ms (spread) | first token p95 ms "
      "| cached (of the oracle's) |")
print("|---|---|---|---|---|---|---|---|")
for n, step in sorted({(k[1], k[2]) for k in keys}):
    for s in sorted({k[0] for k in keys if k[1] == n and k[2] == step}, key=rank):
        rs = [r.get((s, n, step)) for r in runs]
        rs = [x for x in rs if x]
        if not rs:
            continue
        oracles = [r.get(("oracle", n, step)) for r in runs]
        cached = []
        for k, x in enumerate([r.get((s, n, step)) for r in runs]):
            if not x:
                continue
            o = oracles[k]
            of = f" ({x['cached'] / o['cached']:.0%})" if o and o["cached"] and s != "oracle" else ""
            cached.append(f"{x['cached']:.1%}{of}")
        print(f"| {n} | {rs[0]['asked']:g} | {s} | {both([x['served'] for x in rs], lambda v: f'{v:.1f}')} "
              f"({spread([x['served'] for x in rs])}) | {both([x['errors'] for x in rs], str)} | "
              f"{both([x['p95'] for x in rs], lambda v: f'{v:.0f}')} ({spread([x['p95'] for x in rs])}) | "
              f"{both([x['ttft95'] for x in rs], lambda v: f'{v:.0f}')} | {', '.join(cached)} |")

print("\n## The issue's targets, per run\n")
print("Past saturation (the best peer serves under 95 % of the asked rate), two readings of \"throughput at "
      "equal p95\": the best peer's served rate where its p95 would equal prefix-aware's (linear between its "
      "ramp's steps, or its own when the p95s are within 10 %; its highest rate when prefix-aware's p95 is past its last step's), and goodput: requests "
      "answered within prefix-aware's p95 of the step, per second, both routers. Refusals are not goodput.\n")
print("| engines | asked /s | run | best peer | prefix-aware / best peer: served | p95 | cached / oracle's "
      "| served / peer's at equal p95 | goodput within prefix-aware's p95 |")
print("|---|---|---|---|---|---|---|---|---|")
for n, step in sorted({(k[1], k[2]) for k in keys}):
    for i, r in enumerate(runs):
        pa = r.get(("prefix-aware", n, step))
        peers = {k[0]: v for k, v in r.items() if k[1] == n and k[2] == step and k[0].startswith(PEERS)}
        if not pa or not peers:
            continue
        # The best peer: the one that serves most, then the lower p95.
        best = max(peers, key=lambda p: (round(peers[p]["served"], 0), -peers[p]["p95"]))
        b = peers[best]
        o = r.get(("oracle", n, step))
        of = f"{pa['cached'] / o['cached']:.0%}" if o and o["cached"] else ""
        eq = gp = ""
        if b["served"] < 0.95 * pa["asked"]:
            ramp = [v for k, v in r.items() if k[0] == best and k[1] == n]
            # Within 10 %, the p95s are equal already (at light load p95
            # is the service time, flat in the load: no line to follow).
            at = b["served"] if pa["p95"] >= 0.9 * b["p95"] else served_at_p95(ramp, pa["p95"])
            eq = f"{pa['served']:.1f} / {at:.1f} = {pa['served'] / at:.2f}x" if at else ""
            g0, g1 = goodput(pa, pa["p95"]), goodput(b, pa["p95"])
            gp = f"{g0:.1f} / {g1:.1f} = {g0 / g1:.2f}x" if g1 else f"{g0:.1f} / 0"
        print(f"| {n} | {pa['asked']:g} | {i + 1} | {best} | {pa['served'] / b['served']:.2f}x | "
              f"{pa['p95']:.0f} vs {b['p95']:.0f} ({pa['p95'] / b['p95']:.2f}x) | {of} | {eq} | {gp} |")

print("\n## Each engine's share of the step's requests\n")
print("Per router and run: the engines' shares of the requests they served in the step, highest first "
      "(an even spread is 100 % / engines), and the highest over the lowest.\n")
print("| engines | asked /s | router | run | shares, highest first (%) | highest / lowest |")
print("|---|---|---|---|---|---|")
for n, step in sorted({(k[1], k[2]) for k in keys}):
    for s in sorted({k[0] for k in keys if k[1] == n and k[2] == step}, key=rank):
        for i, r in enumerate(runs):
            x = r.get((s, n, step))
            if not x or not x["engines"] or sum(x["engines"]) == 0:
                continue
            e = sorted(x["engines"], reverse=True)
            total = sum(e)
            ratio = f"{e[0] / e[-1]:.1f}x" if e[-1] else "inf"
            print(f"| {n} | {x['asked']:g} | {s} | {i + 1} | {' '.join(f'{100 * v / total:.1f}' for v in e)} | {ratio} |")
