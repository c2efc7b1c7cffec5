#!/usr/bin/env python3
"""Priority classes and tenant fairness (issue 32), this build against
another (BEFORE_BIN: the build before the feature), same sims, same load,
back to back. One router (--shards 1), one hivenet-sim (first token after
100 ms, 16 tokens 5 ms apart) behind one agent of capacity 32, static keys;
every tenant is one hivenet-bench process with its own key, streaming.

1. flood: three calm tenants at 30 req/s each (below their share of the
   engine's ~175 req/s), alone; then with a fourth tenant at 440 req/s
   (10x its share). Reports the calm tenants' p99 time to first event
   against alone (target: within 1.2x).
2. classes: a batch tenant keeps the engine saturated (96 connections,
   closed loop) while an interactive tenant sends 10 req/s. Reports the
   interactive p99 time to first event against alone, and its queue wait
   from the router's histogram (target: p99 under 100 ms), and what batch
   was served.
3. jain: 8 standard tenants, all backlogged with unequal demand (8 to 96
   connections each, --queue-depth 1000): Jain's index of the tokens
   served to each (target: at least 0.95).

LIGHT=1: a slow engine and rates to match (the load generators then leave
the two cores to the router; see the variable).

Usage: BEFORE_BIN=/path/to/release DUR=20 [LIGHT=1] OUT=perf/<dir> scripts/bench/fairness.py
"""
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lib import Fleet, free_port, wait_until  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("HN_BIN", os.path.join(ROOT, "target", "release"))
BEFORE = os.environ.get("BEFORE_BIN", "")
DUR = int(os.environ.get("DUR", "20"))
# LIGHT=1: a slow engine (first token after 1 s, 16 tokens 20 ms apart) and
# rates scaled down to match, so that the load generators leave the
# machine's two cores to the router: what is measured is the queue.
LIGHT = os.environ.get("LIGHT", "0") == "1"
SIM_ARGS = (["--ttft", "1s", "--itl", "20ms"] if LIGHT else ["--ttft", "100ms", "--itl", "5ms"]) + \
    ["--output-tokens", "256", "--threads", "2"]  # each request's max_tokens decides (MAX_TOKENS)
# MIN_SHARE="interactive: 0.1": this build runs with that policy's min_share.
MIN_SHARE = os.environ.get("MIN_SHARE", "")
# FLOOD_AFTER=2: the flooding tenant starts that many seconds after the
# calm ones (they are running when it starts, the steady state the target
# is about); 0: all at once (the calm tenants then find every slot taken
# by the flood's first wave and wait for its end).
FLOOD_AFTER = float(os.environ.get("FLOOD_AFTER", "2"))
# SAME_SEED=1: every tenant's bench with seed 1, as before 2026-12-04 (the
# calm tenants' requests then arrive at the same instants).
SAME_SEED = os.environ.get("SAME_SEED", "0") == "1"
# TENANT_HEADROOM=4: this build runs with that policy's tenant_headroom
# (unset: the default).
HEADROOM = os.environ.get("TENANT_HEADROOM", "")
CALM_RATE, FLOOD_RATE, INT_RATE, BATCH_CONNS = ("4", "60", "2", "64") if LIGHT else ("30", "440", "10", "96")
OUT = os.environ.get("OUT", "")
# MAX_TOKENS="4-64": each request's max_tokens drawn in that range (the sim
# answers that many tokens), so service times vary as a real engine's do
# (default 16: every request the same).
MAX_TOKENS = os.environ.get("MAX_TOKENS", "16")
# PHASES="flood classes": only those (default all three).
PHASES = os.environ.get("PHASES", "flood classes jain").split()
ADMIN = "bench-admin"
MODEL = "sim-model"
TENANTS = {"calm1": "standard", "calm2": "standard", "calm3": "standard", "flood": "standard",
           "int": "interactive", "batch": "batch"}
TENANTS.update({f"t{i}": "standard" for i in range(8)})


def auth_yaml(priorities):
    """The keys; without `priorities` for a build that has no classes."""
    lines = ["api:", "  mode: api-key", "  keys:"]
    for name, prio in TENANTS.items():
        h = hashlib.sha256(f"sk-{name}".encode()).hexdigest()
        lines += [f'    - key_hash: "{h}"', f"      metadata: {{name: {name}, owner: {name}}}"]
        if priorities:
            lines.append(f"      priority: {prio}")
    return "\n".join(lines) + "\n"


def metric_lines(port, prefix):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return [ln for ln in r.read().decode().splitlines() if ln.startswith(prefix)]


def hist_p99(port, cls):
    """p99 upper bound from hivenet_queue_wait_seconds{class=cls} buckets."""
    buckets = []
    for ln in metric_lines(port, "hivenet_queue_wait_seconds_bucket"):
        if f'class="{cls}"' not in ln:
            continue
        le = ln.split('le="')[1].split('"')[0]
        buckets.append((float("inf") if le == "+Inf" else float(le), float(ln.split()[-1])))
    buckets.sort()
    if not buckets or buckets[-1][1] == 0:
        return None, 0
    total = buckets[-1][1]
    for le, n in buckets:
        if n >= 0.99 * total:
            return le, int(total)
    return None, int(total)


class Setup:
    def __init__(self, router_bin, work, extra=()):
        self.work = work
        os.makedirs(work, exist_ok=True)
        with open(os.path.join(work, "auth.yaml"), "w") as f:
            f.write(auth_yaml(router_bin == BIN))
        env = dict(os.environ, HIVENET_ROUTER_ADMIN_API_KEYS=ADMIN, HIVENET_ROUTER_AUDIT_LOG_PATH="off",
                   RUST_LOG="warn")
        self.fleet = Fleet(BIN, work, env)
        self.http, self.met, p2p, sim = free_port(), free_port(), free_port(), free_port()
        if (MIN_SHARE or HEADROOM) and router_bin == BIN:
            with open(os.path.join(work, "policy.yaml"), "w") as f:
                f.write("routing_policy:\n  strategy: least-loaded\n"
                        + (f"min_share: {{{MIN_SHARE}}}\n" if MIN_SHARE else "")
                        + (f"tenant_headroom: {HEADROOM}\n" if HEADROOM else ""))
            extra = list(extra) + ["--policy-file", "policy.yaml"]
        # The router under test may come from another build.
        self.fleet.bin = router_bin
        self.fleet.router(self.http, self.met, p2p, ["--shards", "1", "--auth-config-file", "auth.yaml",
                                                     "--disk-db-path", os.path.join(work, "db")] + list(extra))
        self.fleet.bin = BIN
        self.fleet.sim(sim, MODEL, SIM_ARGS)
        self.fleet.agent(p2p, sim, "agent.key", ["--capacity", "32", "--warmup", "off"])

        def up():
            req = urllib.request.Request(f"http://127.0.0.1:{self.http}/admin/routing-table",
                                         headers={"Authorization": f"Bearer {ADMIN}"})
            with urllib.request.urlopen(req, timeout=5) as r:
                return len(json.load(r)["agents"]) == 1
        wait_until(up, "agent registered")

    def load(self, name, specs):
        """Run one hivenet-bench per (tenant, args) at once; their reports."""
        procs = []
        for i, (tenant, args) in enumerate(specs):
            out = os.path.join(self.work, f"{name}-{tenant}.json")
            # Each tenant its own seed: independent arrivals (one seed for
            # all made the calm tenants' requests arrive at the same
            # instants, three at a time).
            args = list(args) + ["--seed", str(1 if SAME_SEED else 1 + i)]
            if tenant == "flood" and FLOOD_AFTER > 0:
                time.sleep(FLOOD_AFTER)
            p = subprocess.Popen([os.path.join(BIN, "hivenet-bench"), "--url", f"http://127.0.0.1:{self.http}",
                                  "--model", MODEL, "--stream", "--max-tokens", MAX_TOKENS, "--quiet",
                                  "--duration", f"{DUR}s", "--api-key", f"sk-{tenant}", "--out", out] + args,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append((tenant, out, p))
        res = {}
        for tenant, out, p in procs:
            p.wait()
            with open(out) as f:
                res[tenant] = json.load(f)
        return res

    def stop(self):
        self.fleet.stop()


def p99(r):
    return r["first_event"]["p99"] if r["first_event"]["count"] else float("nan")


def run_build(label, router_bin, root):
    rows = {}
    # 1. flood
    if "flood" not in PHASES:
        return run_rest(label, router_bin, root, rows)
    s = Setup(router_bin, os.path.join(root, f"{label}-flood"))
    try:
        calm = [(f"calm{i}", ["--rate", CALM_RATE]) for i in (1, 2, 3)]
        alone = s.load("alone", calm)
        flood = s.load("flood", calm + [("flood", ["--rate", FLOOD_RATE])])
    finally:
        s.stop()
    rows["flood"] = (alone, flood)
    return run_rest(label, router_bin, root, rows)


def run_rest(label, router_bin, root, rows):
    # 2. classes
    if "classes" not in PHASES:
        return run_jain(label, router_bin, root, rows)
    s = Setup(router_bin, os.path.join(root, f"{label}-classes"))
    try:
        ialone = s.load("int-alone", [("int", ["--rate", INT_RATE])])
        mixed = s.load("mixed", [("int", ["--rate", INT_RATE]), ("batch", ["--connections", BATCH_CONNS])])
        wait = hist_p99(s.met, "interactive")
    finally:
        s.stop()
    rows["classes"] = (ialone, mixed, wait)
    return run_jain(label, router_bin, root, rows)


def run_jain(label, router_bin, root, rows):
    # 3. jain
    if "jain" not in PHASES:
        return rows
    s = Setup(router_bin, os.path.join(root, f"{label}-jain"), ["--queue-depth", "1000"])
    try:
        conns = [8, 12, 16, 24, 32, 48, 64, 96]
        res = s.load("jain", [(f"t{i}", ["--connections", str(c)]) for i, c in enumerate(conns)])
    finally:
        s.stop()
    served = [res[f"t{i}"]["ok"] for i in range(8)]
    jain = sum(served) ** 2 / (len(served) * sum(x * x for x in served)) if any(served) else 0
    rows["jain"] = (conns, served, jain)
    return rows


def main():
    root = tempfile.mkdtemp(prefix="hivenet-fairness-")
    builds = [("this build", BIN)] + ([("before", BEFORE)] if BEFORE else [])
    results = {label: run_build(label.replace(" ", "-"), b, root) for label, b in builds}
    lines = [f"{DUR} s per load; sim {' '.join(SIM_ARGS)}; agent capacity 32; rates: calm {CALM_RATE}/s each, "
             f"flood {FLOOD_RATE}/s, interactive {INT_RATE}/s, batch {BATCH_CONNS} connections"
             + (f"; this build with min_share {{{MIN_SHARE}}}" if MIN_SHARE else "")
             + (f"; this build with tenant_headroom {HEADROOM}" if HEADROOM else "")
             + f"; max_tokens {MAX_TOKENS}; flood starts {FLOOD_AFTER:g} s after the calm tenants"
             + ("; every tenant seed 1" if SAME_SEED else "; a seed per tenant"), ""]
    lines += ["## 1. A tenant flooding at 10x its share", "",
              "| build | calm tenant | p99 first event alone ms | with the flood ms | ratio | flood served / sent |",
              "|---|---|---|---|---|---|"]
    for label, r in results.items():
        if "flood" not in r:
            continue
        alone, flood = r["flood"]
        for t in ("calm1", "calm2", "calm3"):
            a, w = p99(alone[t]), p99(flood[t])
            lines.append(f"| {label} | {t} | {a:.0f} | {w:.0f} | {w / a:.2f} | "
                         f"{flood['flood']['ok']} / {flood['flood']['sent']} |")
    lines += ["", "## 2. Interactive against a saturating batch tenant", "",
              "| build | interactive p99 first event alone ms | with batch ms | its queue wait p99 (bucket bound) | "
              "batch served req/s | interactive errors |", "|---|---|---|---|---|---|"]
    for label, r in results.items():
        if "classes" not in r:
            continue
        ialone, mixed, (wb, n) = r["classes"]
        lines.append(f"| {label} | {p99(ialone['int']):.0f} | {p99(mixed['int']):.0f} | "
                     f"{'<= %.0f ms' % (wb * 1000) if wb is not None else 'n/a'} ({n} waits) | "
                     f"{mixed['batch']['ok'] / DUR:.0f} | {mixed['int']['errors']} |")
    lines += ["", "## 3. Eight backlogged tenants, unequal demand", "",
              "| build | connections | requests served | Jain's index |", "|---|---|---|---|"]
    for label, r in results.items():
        if "jain" not in r:
            continue
        conns, served, jain = r["jain"]
        lines.append(f"| {label} | {conns} | {served} | {jain:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    print("work:", root)
    if OUT:
        os.makedirs(OUT, exist_ok=True)
        name = ("summary-light" if LIGHT else "summary") + ("-min-share" if MIN_SHARE else "") \
            + os.environ.get("SUFFIX", "") + ".md"
        with open(os.path.join(OUT, name), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
