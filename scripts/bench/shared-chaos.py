#!/usr/bin/env python3
"""Chaos under load for several routers sharing Redis (issue 31): a real
redis-server, ROUTERS routers (release build, dynamic keys,
--shared-state, default fail-open), one hivenet-sim behind one agent
linked to all of them, CLIENTS closed-loop clients spread over the
routers with one key whose daily token budget and rate never refuse (so
every request is served and its tokens charged). During DUR seconds:

  at 1/5: Redis paused 5 s (DEBUG SLEEP 5);
  at 2/5: Redis killed (-9) and restarted empty;
  at 3/5: one router killed (-9); its clients move to the next router.

Reports: every request answered (HTTP status or a connection error, by
router), statuses, requests the engine served against those the clients
saw served (nothing served twice), and the shared token counter in Redis
against the tokens the clients were served (nothing lost beyond the
documented window: the killed router's credit; over-counted at most the
leases the routers hold unspent).

Usage: ROUTERS=4 CLIENTS=8 DUR=50 OUT=perf/<dir> scripts/bench/shared-chaos.py
"""
import hashlib
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lib import Fleet, free_port, routers_behind_one_agent, wait_until  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("HN_BIN", os.path.join(ROOT, "target", "release"))
ROUTERS = int(os.environ.get("ROUTERS", "4"))
CLIENTS = int(os.environ.get("CLIENTS", "8"))
DUR = float(os.environ.get("DUR", "50"))
OUT = os.environ.get("OUT", "")
ADMIN = "bench-admin"
MODEL = "sim-model"
TPD = 10 ** 7  # lease 10,000 tokens: never exhausted in a run, its lease small


def admin(port, method, path, body=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        h = {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN}"}
        c.request(method, path, body=json.dumps(body) if body is not None else None, headers=h)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def start_redis(port, work):
    return subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--enable-debug-command", "yes"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=work)


def redis_cli(port, *args, timeout=10):
    out = subprocess.run(["redis-cli", "-p", str(port)] + list(args), capture_output=True, text=True,
                         timeout=timeout)
    return out.stdout.strip()


def client(idx, https, stop, out):
    """Closed loop; on a connection error, the next router."""
    body = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "count to ten"}]}
    r = idx % len(https)
    c = http.client.HTTPConnection("127.0.0.1", https[r], timeout=30)
    n = 0
    while not stop():
        n += 1
        h = {"Content-Type": "application/json", "Authorization": "Bearer sk-chaos",
             "X-Client-Request-ID": f"c{idx}-{n}"}
        try:
            c.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=h)
            resp = c.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as e:
            out.append((time.monotonic(), r, "error:" + type(e).__name__, 0))
            c.close()
            r = (r + 1) % len(https)
            c = http.client.HTTPConnection("127.0.0.1", https[r], timeout=30)
            continue
        tokens = 0
        if resp.status == 200:
            u = json.loads(data).get("usage") or {}
            tokens = int(u.get("prompt_tokens", 0)) + int(u.get("completion_tokens", 0))
        out.append((time.monotonic(), r, resp.status, tokens))
    c.close()


def metric_value(port, name):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.split()[-1])
    return 0.0


def sim_served(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:request_success_total"):
                return int(float(line.split()[-1]))
    return -1


def main():
    work = tempfile.mkdtemp(prefix="hivenet-shared-chaos-")
    rport = free_port()
    redis = [start_redis(rport, work)]
    env = dict(os.environ, HIVENET_ROUTER_ADMIN_API_KEYS=ADMIN, HIVENET_ROUTER_AUTH_MODE="dynamic",
               HIVENET_ROUTER_AUDIT_LOG_PATH="off", RUST_LOG="info")
    lines, events = [], []
    try:
        with Fleet(BIN, work, env) as fleet:
            https, mets, procs, sim = routers_behind_one_agent(
                fleet, work, ROUTERS, lambda i: ["--shared-state", f"redis://127.0.0.1:{rport}/0"],
                ["--ttft", "2ms", "--itl", "1ms", "--output-tokens", "16"], 64, ADMIN)
            for h in https:
                wait_until(lambda h=h: admin(h, "GET", "/admin/api-keys")[0] == 200, "router up")
            dto = {"version": "v1", "key_hash": hashlib.sha256(b"sk-chaos").hexdigest(), "owner": "chaos",
                   "name": "chaos", "allowed_models": [MODEL],
                   "quota": {"tokens_per_day": TPD, "requests_per_minute": 10 ** 8}}
            st, b = admin(https[0], "PUT", "/admin/api-keys/chaos", dto)
            assert st == 200, (st, b)
            for h in https:
                wait_until(lambda h=h: json.loads(admin(h, "GET", "/admin/api-keys")[1])["version"] == "v1",
                           "key on every router")
            served0 = sim_served(sim)
            t0 = time.monotonic()
            results = [[] for _ in range(CLIENTS)]
            stop = lambda: time.monotonic() - t0 >= DUR  # noqa: E731
            threads = [threading.Thread(target=client, args=(i, https, stop, results[i])) for i in range(CLIENTS)]
            for t in threads:
                t.start()

            def at(frac):
                while time.monotonic() - t0 < DUR * frac:
                    time.sleep(0.05)

            at(0.2)
            events.append((time.monotonic() - t0, "Redis paused 5 s (DEBUG SLEEP 5)"))
            subprocess.Popen(["redis-cli", "-p", str(rport), "DEBUG", "SLEEP", "5"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            at(0.4)
            events.append((time.monotonic() - t0, "Redis killed -9 and restarted empty"))
            redis[0].send_signal(signal.SIGKILL)
            redis[0].wait()
            time.sleep(1)
            redis[0] = start_redis(rport, work)
            at(0.6)
            victim = ROUTERS - 1
            events.append((time.monotonic() - t0, f"router {victim} killed -9"))
            procs[victim].send_signal(signal.SIGKILL)
            for t in threads:
                t.join()
            time.sleep(1.5)  # the last draws land
            day = int(time.time()) // 86400
            key = f"hivenet:quota:tokens:{day}:chaos:"
            counter_now = int(redis_cli(rport, "GET", key) or "0")
            fail_open = 0
            for i, m in enumerate(mets):
                if i != victim:
                    fail_open += int(metric_value(m, "hivenet_shared_quota_fail_open_total"))
            # Idle for 30 s, the routers give their leases back: the
            # counter is then what was spent.
            time.sleep(33)
            allr = [x for r in results for x in r]
            ok = [x for x in allr if x[2] == 200]
            errs = [x for x in allr if isinstance(x[2], str)]
            other = [x for x in allr if not isinstance(x[2], str) and x[2] != 200]
            used = sum(x[3] for x in ok)
            served = sim_served(sim) - served0
            counter = int(redis_cli(rport, "GET", key) or "0")
            by_router = {}
            for x in errs:
                by_router[x[1]] = by_router.get(x[1], 0) + 1
            lines += [f"routers {ROUTERS} (--shared-state, fail-open), clients {CLIENTS}, {DUR:.0f} s", ""]
            lines += [f"- {t:.1f} s: {e}" for (t, e) in events]
            lines += [
                "",
                "| | value |",
                "|---|---|",
                f"| requests sent | {len(allr)} |",
                f"| answered 200 | {len(ok)} |",
                f"| answered another status | {len(other)} {sorted(set(x[2] for x in other))} |",
                f"| connection errors (then the next router) | {len(errs)} by router {by_router} |",
                f"| served by the engine | {served} |",
                f"| served by the engine - answered 200 | {served - len(ok)} |",
                f"| tokens served to clients | {used} |",
                f"| requests admitted fail-open (Redis away), surviving routers | {fail_open} |",
                f"| shared counter right after the load (leases held) | {counter_now} |",
                f"| shared counter 33 s later (idle leases given back) | {counter} |",
                f"| counter - tokens served | {counter - used} ({(counter - used) / used if used else 0:+.4%}) |",
                f"| documented window: the killed router's lease unspent (over) or credit (under) | "
                f"lease {TPD // 1000} or twice its pace |",
            ]
    finally:
        redis[0].terminate()
        redis[0].wait()
    text = "\n".join(lines) + "\n"
    print(text)
    print("work dir:", work)
    if OUT:
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, "chaos.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
