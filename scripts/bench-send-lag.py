#!/usr/bin/env python3
"""The load generator's own lateness (issue 14).

hivenet-bench in open loop straight at hivenet-sim, one worker thread
pinned to CPU 0 and the simulator to CPU 1: send lag (intended time ->
request written) at each rate, spinning the last --spin before each send
(the default) and sleeping only (--spin 0), with the generator's own CPU.
Then wrk and hivenet-bench in closed loop at one connection against the
same simulator, so the generator's latency figures can be set beside
wrk's. Results: OUT (default perf/<date>-send-lag) with summary.md.

usage: scripts/bench-send-lag.py   (env: DUR=10s RATES="2000 5000 10000")
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.chdir(ROOT)
DUR = os.environ.get("DUR", "10s")
RATES = [int(r) for r in os.environ.get("RATES", "2000 5000 10000").split()]
SPINS = os.environ.get("SPINS", "100us 0").split()
OUT = os.environ.get("OUT", f"perf/{datetime.now(timezone.utc):%Y-%m-%d}-send-lag")
BIN = os.path.join(ROOT, "target/release")


def sh(cmd):
    return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def run_timed(args, **kw):
    """Run to the end; return (stdout, user+system CPU seconds)."""
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        sys.exit(f"{args[0]} failed ({p.returncode}): {out}")
    return out, ru.ru_utime + ru.ru_stime


def main():
    if not shutil.which("wrk"):
        subprocess.run("apt-get update -qq && apt-get install -y -qq wrk >/dev/null", shell=True, check=True)
    subprocess.run(["cargo", "build", "-q", "--release", "-p", "bench", "--bins"], check=True)
    os.makedirs(f"{OUT}/reports", exist_ok=True)
    with open(f"{OUT}/env.txt", "w") as f:
        f.write(f"date: {datetime.now(timezone.utc):%Y-%m-%dT%H:%M:%SZ}\n")
        dirty = "" if subprocess.run(["git", "diff", "--quiet"]).returncode == 0 else " (dirty)"
        f.write(f"commit: {sh('git rev-parse HEAD')}{dirty}\n")
        f.write(f"nproc: {os.cpu_count()}\nkernel: {os.uname().release}\n")
        f.write(f"rustc: {sh('rustc --version')}\nwrk: {sh('wrk -v 2>&1 | head -1')}\n")
        f.write(f"cmd: DUR={DUR} RATES=\"{' '.join(map(str, RATES))}\" SPINS=\"{' '.join(SPINS)}\" scripts/bench-send-lag.py\n")
    port = free_port()
    sim = subprocess.Popen(
        ["taskset", "-c", "1", f"{BIN}/hivenet-sim", "--port", str(port), "--model", "sim-model",
         "--output-tokens", "16"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        rows = []
        # Poisson with and without the busy wait; constant arrivals (no
        # bursts: two Poisson arrivals closer than one send's duration make
        # the second late by the first's send) with it.
        runs = [("poisson", spin) for spin in SPINS] + [("constant", SPINS[0])]
        for rate in RATES:
            for arr, spin in runs:
                name = f"open-{rate}-{arr}-spin-{spin}"
                js = f"{OUT}/reports/{name}.json"
                _, cpu = run_timed([f"{BIN}/hivenet-bench", "--url", url, "--rate", str(rate),
                                    "--arrivals", arr, "--duration", DUR, "--cpus", "0",
                                    "--spin", spin, "--quiet", "--max-tokens", "16", "--out", js])
                r = json.load(open(js))
                rows.append((rate, arr, spin, r, cpu / r["elapsed_s"]))
                os.remove(js.replace(".json", ".svg"))
        # Closed loop, one connection: hivenet-bench and wrk, same target.
        js = f"{OUT}/reports/closed-1-bench.json"
        _, bcpu = run_timed([f"{BIN}/hivenet-bench", "--url", url, "--connections", "1",
                             "--duration", DUR, "--cpus", "0", "--quiet", "--max-tokens", "16",
                             "--out", js])
        os.remove(js.replace(".json", ".svg"))
        closed = json.load(open(js))
        body = json.dumps({"model": "sim-model", "max_tokens": 16,
                           "messages": [{"role": "user", "content": "hello there, how are you"}]})
        lua = f"{OUT}/reports/post.lua"
        with open(lua, "w") as f:
            f.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                    f"wrk.body = {json.dumps(body)}\n")
        wout, wcpu = run_timed(["taskset", "-c", "0", "wrk", "-t1", "-c1", "-d", DUR, "--latency",
                                "-s", lua, f"{url}/v1/chat/completions"])
        with open(f"{OUT}/reports/closed-1-wrk.txt", "w") as f:
            f.write(wout)
    finally:
        sim.terminate()
        sim.wait()

    def pct(label):
        m = re.search(rf"^\s*{label}%\s+([\d.]+)(us|ms|s)\s*$", wout, re.M)
        if not m:
            return float("nan")
        v, u = float(m.group(1)), m.group(2)
        return v / 1000 if u == "us" else v * 1000 if u == "s" else v

    wrk_rps = float(re.search(r"Requests/sec:\s+([\d.]+)", wout).group(1))
    lines = [
        "# Load generator send lag",
        "",
        f"`{open(f'{OUT}/env.txt').read().splitlines()[-1][5:]}`; machine and commit in env.txt.",
        "hivenet-bench (1 worker thread, CPU 0) in open loop straight at hivenet-sim (CPU 1,",
        "non-streaming chat, 16 tokens). Send lag = start of the request's send system call",
        "minus its intended time (--spin 0: timerfd wake-up only, no busy wait); service =",
        "send to response end; bench CPU = the generator's user+system seconds per second.",
        "",
        "| rate (req/s) | arrivals | --spin | achieved | send lag p50 (us) | p99 (us) | p99.9 (us) | max (us) | service p50 (us) | bench CPU (cores) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate, arr, spin, r, cores in rows:
        s, v = r["send_lag"], r["service"]
        lines.append(f"| {rate} | {arr} | {spin} | {r['achieved_rps']:.0f} | {s['p50']*1000:.0f} | {s['p99']*1000:.0f} | "
                     f"{s['p999']*1000:.0f} | {s['max']*1000:.0f} | {v['p50']*1000:.0f} | {cores:.2f} |")
    t = closed["total"]
    lines += [
        "",
        "Closed loop, one connection, same simulator (wrk 1 thread on CPU 0):",
        "",
        "| client | req/s | p50 (us) | p99 (us) | client CPU (cores) |",
        "|---|---|---|---|---|",
        f"| hivenet-bench | {closed['achieved_rps']:.0f} | {t['p50']*1000:.0f} | {t['p99']*1000:.0f} | {bcpu / closed['elapsed_s']:.2f} |",
        f"| wrk | {wrk_rps:.0f} | {pct(50)*1000:.0f} | {pct(99)*1000:.0f} | {wcpu / float(DUR.rstrip('s')):.2f} |",
        "",
    ]
    with open(f"{OUT}/summary.md", "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
