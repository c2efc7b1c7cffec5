#!/usr/bin/env python3
"""One quota over several routers (issue 31): a real redis-server, ROUTERS
routers (release build, dynamic keys, --shared-state unless SHARED=0), one
hivenet-sim behind one agent linked to all of them, CLIENTS closed-loop
clients spread over the routers, sending as fast as they can.

Phase 1, requests: one key limited to RPM requests a minute (burst: the
whole minute, the default), DUR seconds. Reports what was admitted against
the GCRA bound (burst + RPM x elapsed minutes), the admissions of every
60 s window after the first minute against RPM, and the Retry-After of the
refusals.

Phase 2, tokens: one key with a daily budget of TPD tokens; the clients
send until every router has refused for 3 s. Reports the tokens used
(prompt + completion of every answered request) against TPD, and the
shared counter in Redis.

Usage: ROUTERS=4 CLIENTS=8 RPM=600 DUR=150 TPD=100000 OUT=perf/<dir> \
       scripts/bench/shared-quota.py
"""
import hashlib
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lib import Fleet, free_port, routers_behind_one_agent, wait_until  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("HN_BIN", os.path.join(ROOT, "target", "release"))
ROUTERS = int(os.environ.get("ROUTERS", "4"))
CLIENTS = int(os.environ.get("CLIENTS", "8"))
RPM = int(os.environ.get("RPM", "600"))
DUR = float(os.environ.get("DUR", "150"))
TPD = int(os.environ.get("TPD", "100000"))
SHARED = os.environ.get("SHARED", "1") != "0"
OUT = os.environ.get("OUT", "")
ADMIN = "bench-admin"
MODEL = "sim-model"


def call(conn, method, path, body=None, key=ADMIN):
    h = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=h)
    r = conn.getresponse()
    data = r.read()
    return r.status, dict((k.lower(), v) for k, v in r.getheaders()), data


def admin(port, method, path, body=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        return call(c, method, path, body)
    finally:
        c.close()


def put_key(https, kid, raw, quota, version):
    dto = {"version": version, "key_hash": hashlib.sha256(raw.encode()).hexdigest(),
           "owner": f"tenant-{kid}", "name": kid, "allowed_models": [MODEL], "quota": quota}
    targets = https[:1] if SHARED else https
    for h in targets:
        st, _, b = admin(h, "PUT", f"/admin/api-keys/{kid}", dto)
        assert st == 200, (st, b)
    for h in https:
        wait_until(lambda h=h: json.loads(admin(h, "GET", "/admin/api-keys")[2])["version"] == version,
                   "key on every router")


def client(port, raw, stop, out):
    """Send until `stop`; append (t, status, retry_after_ms, tokens)."""
    body = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "count to ten"}]}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    while not stop():
        try:
            st, h, data = call(c, "POST", "/v1/chat/completions", body, raw)
        except (OSError, http.client.HTTPException):
            c.close()
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            continue
        tokens = 0
        if st == 200:
            u = json.loads(data).get("usage") or {}
            tokens = int(u.get("prompt_tokens", 0)) + int(u.get("completion_tokens", 0))
        ra = None
        if st == 429:
            ra = (int(h.get("retry-after", "0")), int(h.get("retry-after-ms", "0")))
        out.append((time.monotonic(), st, ra, tokens))
    c.close()


def run_clients(https, raw, stop):
    results = [[] for _ in range(CLIENTS)]
    threads = [threading.Thread(target=client, args=(https[i % len(https)], raw, stop, results[i]))
               for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else 0


def redis_get(port, key):
    out = subprocess.run(["redis-cli", "-p", str(port), "GET", key], capture_output=True, text=True)
    return out.stdout.strip()


def main():
    work = tempfile.mkdtemp(prefix="hivenet-shared-quota-")
    rport = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=work)
    env = dict(os.environ, HIVENET_ROUTER_ADMIN_API_KEYS=ADMIN, HIVENET_ROUTER_AUTH_MODE="dynamic",
               HIVENET_ROUTER_AUDIT_LOG_PATH="off", RUST_LOG="warn")
    lines = []
    try:
        with Fleet(BIN, work, env) as fleet:
            shared = ["--shared-state", f"redis://127.0.0.1:{rport}/0"] if SHARED else []
            https, _, _, _ = routers_behind_one_agent(
                fleet, work, ROUTERS, lambda i: shared,
                ["--ttft", "2ms", "--itl", "1ms", "--output-tokens", "16"], 64, ADMIN)
            mode = "shared (--shared-state)" if SHARED else "alone (no --shared-state)"
            lines.append(f"routers {ROUTERS} {mode}, clients {CLIENTS} (closed loop, spread over the routers)")

            # Phase 1: requests a minute.
            put_key(https, "rpm", "sk-rpm", {"requests_per_minute": RPM}, "v1")
            t0 = time.monotonic()
            res = run_clients(https, "sk-rpm", lambda: time.monotonic() - t0 >= DUR)
            allr = sorted(x for r in res for x in r)
            ok = [t - t0 for (t, st, _, _) in allr if st == 200]
            refused = [ra for (_, st, ra, _) in allr if st == 429]
            other = sum(1 for (_, st, _, _) in allr if st not in (200, 429))
            elapsed = max((t for (t, _, _, _) in allr), default=t0) - t0
            bound = RPM + RPM * elapsed / 60
            lease = max(1, RPM // 200)
            lines += [
                "",
                f"## Requests: one key, {RPM} a minute (burst {RPM}), {elapsed:.0f} s",
                "",
                "| | value |",
                "|---|---|",
                f"| sent | {len(allr)} |",
                f"| admitted | {len(ok)} |",
                f"| refused 429 | {len(refused)} |",
                f"| other statuses | {other} |",
                f"| GCRA bound (burst + rate x {elapsed:.0f} s) | {bound:.0f} |",
                f"| admitted / bound | {len(ok) / bound:.4f} |",
                f"| documented credit (routers x lease {lease}) | {ROUTERS * lease} |",
            ]
            lines += ["", "| 60 s window | admitted | / RPM |", "|---|---|---|"]
            w = 60.0
            while w + 60 <= elapsed + 0.5:
                n = sum(1 for t in ok if w <= t < w + 60)
                lines.append(f"| {w:.0f}-{w + 60:.0f} s | {n} | {n / RPM:.4f} |")
                w += 30
            if refused:
                secs = [a for (a, _) in refused]
                ms = [b for (_, b) in refused]
                lines += ["", f"Retry-After of the refusals (s): min {min(secs)} p50 {pct(secs, 50)} "
                              f"p95 {pct(secs, 95)} max {max(secs)}; retry-after-ms p50 {pct(ms, 50)} "
                              f"p95 {pct(ms, 95)} max {max(ms)}"]
            per_router = [sum(1 for (_, st, _, _) in res[i] if st == 200) for i in range(CLIENTS)]
            lines.append(f"admitted per client: {per_router}")

            # Phase 2: tokens a day.
            put_key(https, "tpd", "sk-tpd", {"tokens_per_day": TPD}, "v2")
            last_ok = [time.monotonic()]
            t1 = time.monotonic()

            def stop():
                return time.monotonic() - last_ok[0] >= 3 or time.monotonic() - t1 > 600

            results = [[] for _ in range(CLIENTS)]

            def watch():
                while not stop():
                    for r in results:
                        if r and r[-1][1] == 200:
                            last_ok[0] = max(last_ok[0], r[-1][0])
                    time.sleep(0.05)

            wt = threading.Thread(target=watch)
            wt.start()
            threads = [threading.Thread(target=client, args=(https[i % ROUTERS], "sk-tpd", stop, results[i]))
                       for i in range(CLIENTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wt.join()
            alltok = [x for r in results for x in r]
            used = sum(tok for (_, st, _, tok) in alltok if st == 200)
            served = sum(1 for (_, st, _, _) in alltok if st == 200)
            need = max((tok for (_, st, _, tok) in alltok if st == 200), default=0)
            time.sleep(0.5)
            day = int(time.time()) // 86400
            counter = redis_get(rport, f"hivenet:quota:tokens:{day}:tenant-tpd:") if SHARED else "n/a"
            lines += [
                "",
                f"## Tokens: one key, {TPD} a day",
                "",
                "| | value |",
                "|---|---|",
                f"| requests served | {served} |",
                f"| tokens used (prompt + completion) | {used} |",
                f"| used / budget | {used / TPD:.4f} |",
                f"| documented credit (routers x max(lease {max(1, TPD // 1000)}, one request ~{need})) | "
                f"{ROUTERS * max(max(1, TPD // 1000), need)} |",
                f"| shared counter in Redis | {counter} |",
                f"| time to exhaust | {max((t for (t, _, _, _) in alltok), default=t1) - t1:.1f} s |",
            ]
    finally:
        redis.terminate()
        redis.wait()
    text = "\n".join(lines) + "\n"
    print(text)
    if OUT:
        os.makedirs(OUT, exist_ok=True)
        name = "summary.md" if SHARED else "alone.md"
        with open(os.path.join(OUT, name), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
