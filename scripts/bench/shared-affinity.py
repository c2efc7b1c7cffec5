#!/usr/bin/env python3
"""Cache affinity across routers (issue 31, --shared-state-affinity): the
engines' cached share of prompt tokens when each turn of a conversation
lands on another router, at 1, 2 and 4 routers, with the routers' prefix
indexes shared through Redis and without.

A real redis-server, R routers (release build, prefix-aware policy,
--shared-state), AGENTS hivenet-sims with prefix caches (4,096 tokens
each, one-token blocks, as calibrated against llama-server in
perf/2026-12-02-sim-calibration; prefill made fast: the figure is a
count), one agent per sim linked to every router. CONVS conversations of
TURNS turns, each with its own system prompt; turn t of conversation c
goes to router (c + t) % R, so at R > 1 every turn moves. CLIENTS
threads run the conversations. Reports the cached share of prompt
tokens over the turns after the first (the first is cold everywhere),
and the routers' affinity decisions.

Usage: ROUTER_COUNTS="1 2 4" AGENTS=4 CONVS=24 TURNS=6 OUT=perf/<dir> \
       scripts/bench/shared-affinity.py
"""
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lib import Fleet, free_port, wait_until  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("HN_BIN", os.path.join(ROOT, "target", "release"))
COUNTS = [int(x) for x in os.environ.get("ROUTER_COUNTS", "1 2 4").split()]
AGENTS = int(os.environ.get("AGENTS", "4"))
CONVS = int(os.environ.get("CONVS", "24"))
TURNS = int(os.environ.get("TURNS", "6"))
CLIENTS = int(os.environ.get("CLIENTS", "4"))
OUT = os.environ.get("OUT", "")
ADMIN = "bench-admin"
MODEL = "sim-model"
SIM = ["--ttft", "2ms", "--prefill-per-token", "50us", "--itl", "1ms", "--output-tokens", "16",
       "--prefix-cache-tokens", "4096", "--cache-block-tokens", "1", "--bytes-per-token", "2.0"]


def get(port, path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("GET", path, headers={"Authorization": f"Bearer {ADMIN}"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def metric_sum(port, prefix):
    total = 0.0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(prefix):
                total += float(line.split()[-1])
    return total


def body(conv, turn):
    system = f"You are assistant number {conv}. " + "Answer with care and cite your sources. " * 12
    msgs = [{"role": "system", "content": system}]
    for t in range(turn + 1):
        msgs.append({"role": "user", "content": f"Question {t} of conversation {conv}: " + "detail " * 20})
        if t < turn:
            msgs.append({"role": "assistant", "content": f"Answer {t}: " + "words " * 16})
    return {"model": MODEL, "max_tokens": 16, "messages": msgs}


def run(routers, shared):
    work = tempfile.mkdtemp(prefix="hivenet-shared-affinity-")
    rport = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=work)
    pol = os.path.join(work, "policy.yaml")
    with open(pol, "w") as f:
        f.write("routing_policy:\n  strategy: prefix-aware\n")
    env = dict(os.environ, HIVENET_ROUTER_ADMIN_API_KEYS=ADMIN, HIVENET_ROUTER_AUDIT_LOG_PATH="off",
               RUST_LOG="warn")
    try:
        with Fleet(BIN, work, env) as fleet:
            https, mets, p2ps = [], [], []
            for i in range(routers):
                h, m, p = free_port(), free_port(), free_port()
                extra = ["--shards", "1", "--policy-file", pol, "--disk-db-path", os.path.join(work, f"db{i}"),
                         "--identity-path", os.path.join(work, f"r{i}.key"),
                         "--shared-state", f"redis://127.0.0.1:{rport}/0"]
                if shared:
                    extra.append("--shared-state-affinity")
                fleet.router(h, m, p, extra, log_name=f"router-{i}")
                https.append(h)
                mets.append(m)
                p2ps.append(p)
            more = []
            for p in p2ps[1:]:
                more += ["--router-p2p", f"/ip4/127.0.0.1/tcp/{p}"]
            for a in range(AGENTS):
                sp = free_port()
                fleet.sim(sp, MODEL, SIM, log_name=f"sim-{a}")
                fleet.agent(p2ps[0], sp, f"agent-{a}.key", ["--capacity", "4", "--warmup", "off",
                                                            "--machine", f"m{a}"] + more)
            for h in https:
                wait_until(lambda h=h: len(json.loads(get(h, "/admin/routing-table")[1])["agents"]) == AGENTS,
                           "every agent on every router")
            stats = {"prompt": 0, "cached": 0, "errors": 0}
            lock = threading.Lock()
            convs = list(range(CONVS))

            def client():
                while True:
                    with lock:
                        if not convs:
                            return
                        c = convs.pop()
                    for t in range(TURNS):
                        port = https[(c + t) % routers]
                        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                        conn.request("POST", "/v1/chat/completions", body=json.dumps(body(c, t)),
                                     headers={"Content-Type": "application/json"})
                        r = conn.getresponse()
                        data = r.read()
                        conn.close()
                        if r.status != 200:
                            with lock:
                                stats["errors"] += 1
                            continue
                        u = json.loads(data).get("usage") or {}
                        if t > 0:
                            with lock:
                                stats["prompt"] += int(u.get("prompt_tokens", 0))
                                stats["cached"] += int((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0))

            threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            dec = {o: sum(metric_sum(m, f'hivenet_affinity_decisions_total{{model="{MODEL}",outcome="{o}"}}')
                          for m in mets) for o in ("key_hit", "prefix_hit", "miss", "overloaded")}
            recv = sum(metric_sum(m, 'hivenet_shared_affinity_notes_total{direction="received"}') for m in mets)
            return stats, dec, recv
    finally:
        redis.terminate()
        redis.wait()


def main():
    lines = [f"agents {AGENTS} (sims with 4,096-token prefix caches), {CONVS} conversations x {TURNS} turns, "
             f"{CLIENTS} clients; turn t of conversation c on router (c + t) % R", "",
             "| routers | indexes shared | cached share of prompt tokens (turns 2+) | prefix hits | misses | "
             "overloaded | notes received | errors |", "|---|---|---|---|---|---|---|---|"]
    for n in COUNTS:
        for shared in ([False] if n == 1 else [False, True]):
            stats, dec, recv = run(n, shared)
            share = stats["cached"] / stats["prompt"] if stats["prompt"] else 0
            lines.append(f"| {n} | {'yes' if shared else 'no'} | {share:.3f} | {dec['prefix_hit']:.0f} | "
                         f"{dec['miss']:.0f} | {dec['overloaded']:.0f} | {recv:.0f} | {stats['errors']} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if OUT:
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, "summary.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
