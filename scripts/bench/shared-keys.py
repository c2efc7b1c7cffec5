#!/usr/bin/env python3
"""Key propagation across routers sharing state (issue 31): a real
redis-server and ROUTERS routers (release build, dynamic keys,
--shared-state). TRIALS times: PUT a new key on router i (i rotating),
then poll router i+ROUTERS/2 every 5 ms with that key until it is
accepted (any status but 401); then DELETE it on the first router and
poll until the other refuses it (401). Reports p50 / p95 / max of both,
from the PUT's (DELETE's) answer to the first poll that sees it.
Target (the issue): in force on every router within 1 s.

Usage: ROUTERS=4 TRIALS=50 OUT=perf/<dir> scripts/bench/shared-keys.py
"""
import hashlib
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lib import free_port, wait_until  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("HN_BIN", os.path.join(ROOT, "target", "release"))
ROUTERS = int(os.environ.get("ROUTERS", "4"))
TRIALS = int(os.environ.get("TRIALS", "50"))
OUT = os.environ.get("OUT", "")
ADMIN = "bench-admin"


def call(port, method, path, body=None, key=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    h = {"Content-Type": "application/json"}
    h["Authorization"] = f"Bearer {key or ADMIN}"
    c.request(method, path, body=json.dumps(body) if body is not None else None, headers=h)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def chat_status(port, key):
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    return call(port, "POST", "/v1/chat/completions", body, key)[0]


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main():
    work = tempfile.mkdtemp(prefix="hivenet-shared-keys-")
    procs = []
    try:
        rport = free_port()
        procs.append(subprocess.Popen(
            ["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=work))
        env = dict(os.environ, HIVENET_ROUTER_ADMIN_API_KEYS=ADMIN, HIVENET_ROUTER_AUTH_MODE="dynamic",
                   HIVENET_ROUTER_AUDIT_LOG_PATH="off")
        https = []
        for i in range(ROUTERS):
            d = os.path.join(work, f"r{i}")
            os.makedirs(d)
            h, m, p = free_port(), free_port(), free_port()
            procs.append(subprocess.Popen(
                [os.path.join(BIN, "hivenet-router"), "--http-port", f"127.0.0.1:{h}",
                 "--metrics-port", f"127.0.0.1:{m}", "--p2p-port", str(p), "--shards", "1",
                 "--shared-state", f"redis://127.0.0.1:{rport}/0"],
                env=env, cwd=d, stdout=open(os.path.join(d, "log"), "w"), stderr=subprocess.STDOUT))
            https.append(h)
        for h in https:
            wait_until(lambda h=h: call(h, "GET", "/admin/api-keys")[0] == 200, "router up")
        put_ms, del_ms = [], []
        for t in range(TRIALS):
            src, dst = https[t % ROUTERS], https[(t + ROUTERS // 2) % ROUTERS]
            raw = f"sk-bench-{t}"
            dto = {"version": f"v{2 * t + 1:06d}", "key_hash": hashlib.sha256(raw.encode()).hexdigest(),
                   "owner": "acme", "name": "bench"}
            st, b = call(src, "PUT", f"/admin/api-keys/k{t}", dto)
            assert st == 200, (st, b)
            t0 = time.monotonic()
            while chat_status(dst, raw) == 401:
                time.sleep(0.005)
            put_ms.append((time.monotonic() - t0) * 1000)
            st, b = call(src, "DELETE", f"/admin/api-keys/k{t}?version=v{2 * t + 2:06d}")
            assert st == 200, (st, b)
            t0 = time.monotonic()
            while chat_status(dst, raw) != 401:
                time.sleep(0.005)
            del_ms.append((time.monotonic() - t0) * 1000)
        lines = [
            f"routers {ROUTERS}, trials {TRIALS} (PUT on router i, polled on router i+{ROUTERS // 2} every 5 ms)",
            "| change | p50 ms | p95 ms | max ms | over 1 s |",
            "|---|---|---|---|---|",
        ]
        for name, xs in (("PUT (key in force)", put_ms), ("DELETE (key refused)", del_ms)):
            lines.append(f"| {name} | {pct(xs, 50):.0f} | {pct(xs, 95):.0f} | {max(xs):.0f} | {sum(1 for x in xs if x > 1000)} |")
        text = "\n".join(lines) + "\n"
        print(text)
        if OUT:
            os.makedirs(OUT, exist_ok=True)
            with open(os.path.join(OUT, "key-propagation.md"), "w") as f:
                f.write(text)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()


if __name__ == "__main__":
    main()
