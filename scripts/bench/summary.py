"""Summarise a bench-compare folder: per run, throughput, latency and CPU per
request; per scenario, ratios to the direct path measured in the same round."""
import collections
import glob
import json
import os
import sys

HZ = os.sysconf("SC_CLK_TCK")
out = sys.argv[1]
cpu = collections.defaultdict(dict)
for line in open(os.path.join(out, "cpu.tsv")):
    name, target, proc, ticks = line.rstrip("\n").split("\t")
    cpu[(name, target)][proc] = int(ticks)

rows = []
for path in sorted(glob.glob(os.path.join(out, "reports", "*.json"))):
    base = os.path.basename(path)[:-5]
    name, target = base.split("-", 1) if False else (None, None)
    rep = json.load(open(path))
    # file name: <name>-<target>.json where target is the last known one
    for t in ("vllm-router", "hivenet-1-shard", "hivenet-2-shard", "hivenet-before", "hivenet", "nginx", "direct"):
        if base.endswith("-" + t):
            name, target = base[: -len(t) - 1], t
            break
    rows.append((name, target, rep))

def us_per_req(name, target, proc, ok):
    t = cpu.get((name, target), {}).get(proc)
    if t is None or ok == 0:
        return None
    return t * 1e6 / HZ / ok

print("# Side-by-side results\n")
print("Environment: see `env.txt`; command: see `cmd.txt`. Latencies in ms; CPU in microseconds of CPU time per successful request (utime+stime from /proc). `added p50` = p50 minus the direct path's p50 in the same round.\n")
by_name = collections.defaultdict(dict)
for name, target, rep in rows:
    by_name[name][target] = rep
print("| run | target | ok | errors | req/s | p50 | p99 | added p50 | headers p50 | first event p50 | added first event | proxy CPU us/req | agent us/req | sim us/req |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for name in sorted(by_name):
    d = by_name[name].get("direct")
    for target in ("direct", "hivenet", "hivenet-before", "nginx", "vllm-router", "hivenet-1-shard", "hivenet-2-shard"):
        rep = by_name[name].get(target)
        if not rep:
            continue
        ok = rep["ok"]
        proxy_proc = {"hivenet": "router", "hivenet-before": "router", "nginx": "nginx", "vllm-router": "vllm-router", "hivenet-1-shard": "router", "hivenet-2-shard": "router"}.get(target)
        px = us_per_req(name, target, proxy_proc, ok) if proxy_proc else None
        ag = us_per_req(name, target, "agent", ok)
        sm = us_per_req(name, target, "sim", ok)
        added = rep["total"]["p50"] - d["total"]["p50"] if d and target != "direct" else None
        fe = rep["first_event"]["p50"] if rep["first_event"]["count"] else None
        added_fe = fe - d["first_event"]["p50"] if (fe is not None and d and d["first_event"]["count"] and target != "direct") else None
        f = lambda v, p=3: "-" if v is None else f"{v:.{p}f}"
        print(f"| {name} | {target} | {ok} | {rep['errors']} | {rep['achieved_rps']:.0f} | {f(rep['total']['p50'])} | {f(rep['total']['p99'])} | {f(added)} | {f(rep['headers']['p50'])} | {f(fe)} | {f(added_fe)} | {f(px, 1)} | {f(ag, 1)} | {f(sm, 1)} |")

# Target checks, averaged over rounds.
def avg(vals):
    vals = [v for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else None

print("\n## Targets (averaged over rounds)\n")
one = [n for n in by_name if n.startswith("one-conn")]
if one:
    h_cpu = avg([us_per_req(n, "hivenet", "router", by_name[n]["hivenet"]["ok"]) for n in one if "hivenet" in by_name[n]])
    v_cpu = avg([us_per_req(n, "vllm-router", "vllm-router", by_name[n]["vllm-router"]["ok"]) for n in one if "vllm-router" in by_name[n]])
    h_add = avg([by_name[n]["hivenet"]["total"]["p50"] - by_name[n]["direct"]["total"]["p50"] for n in one if "hivenet" in by_name[n]])
    v_add = avg([by_name[n]["vllm-router"]["total"]["p50"] - by_name[n]["direct"]["total"]["p50"] for n in one if "vllm-router" in by_name[n]])
    if h_cpu and v_cpu:
        print(f"- router CPU per proxied non-streaming request (1 connection): hivenet-router {h_cpu:.1f} us, vllm-router {v_cpu:.1f} us: ratio {h_cpu / v_cpu:.2f} (target <= 0.20)")
    if h_add is not None and v_add is not None:
        print(f"- added median latency at one connection: hivenet (two hops) {h_add * 1000:.0f} us, vllm-router {v_add * 1000:.0f} us (target: below vllm-router)")
    b_cpu = avg([us_per_req(n, "hivenet-before", "router", by_name[n]["hivenet-before"]["ok"]) for n in one if "hivenet-before" in by_name[n]])
    b_add = avg([by_name[n]["hivenet-before"]["total"]["p50"] - by_name[n]["direct"]["total"]["p50"] for n in one if "hivenet-before" in by_name[n]])
    if b_cpu and h_cpu and b_add is not None:
        print(f"- this build vs hivenet-before (1 connection): router CPU {h_cpu:.1f} vs {b_cpu:.1f} us/req ({h_cpu / b_cpu:.2f}x), added p50 {h_add * 1000:.0f} vs {b_add * 1000:.0f} us")
op = sorted({n.rsplit("-r", 1)[0] for n in by_name if n.startswith("open-")}, key=lambda s: int(s.split("-")[1]))
for rate in op:
    ns = [n for n in by_name if n.rsplit("-r", 1)[0] == rate]
    def a(target, f):
        return avg([f(n) for n in ns if target in by_name[n]])
    hc = a("hivenet", lambda n: us_per_req(n, "hivenet", "router", by_name[n]["hivenet"]["ok"]))
    bc = a("hivenet-before", lambda n: us_per_req(n, "hivenet-before", "router", by_name[n]["hivenet-before"]["ok"]))
    vc = a("vllm-router", lambda n: us_per_req(n, "vllm-router", "vllm-router", by_name[n]["vllm-router"]["ok"]))
    hp = a("hivenet", lambda n: by_name[n]["hivenet"]["total"]["p50"])
    bp = a("hivenet-before", lambda n: by_name[n]["hivenet-before"]["total"]["p50"])
    f = lambda v, k=1.0, p=1: "-" if v is None else f"{v * k:.{p}f}"
    print(f"- {rate}: router CPU us/req hivenet {f(hc)}, before {f(bc)}, vllm-router {f(vc)}; p50 ms hivenet {f(hp, 1.0, 3)}, before {f(bp, 1.0, 3)}")
st = [n for n in by_name if n.startswith("stream-")]
if st:
    adds = [by_name[n]["hivenet"]["first_event"]["p50"] - by_name[n]["direct"]["first_event"]["p50"] for n in st if "hivenet" in by_name[n]]
    print(f"- added time to first streamed event (p50, per run): {', '.join(f'{a * 1000:.0f} us' for a in adds)} (target <= 300 us)")
sh = [n for n in by_name if n.startswith("shards")]
if sh:
    one_s = avg([by_name[n]["hivenet-1-shard"]["achieved_rps"] for n in sh if "hivenet-1-shard" in by_name[n]])
    two_s = avg([by_name[n]["hivenet-2-shard"]["achieved_rps"] for n in sh if "hivenet-2-shard" in by_name[n]])
    if one_s and two_s:
        print(f"- two models, 2 shards vs 1 shard: {two_s:.0f} vs {one_s:.0f} req/s = {two_s / one_s:.2f}x (target >= 1.8x)")
