#!/usr/bin/env python3
"""The load generator's own lateness (issue 14).

hivenet-bench in open loop straight at hivenet-sim, one worker thread
pinned to CPU 0 and the simulator to CPU 1: send lag (intended time ->
request written) at each rate, spinning the last --spin before each send
(the default) and sleeping only (--spin 0), with the generator's own CPU.
Then wrk and hivenet-bench in closed loop at one connection against the
same simulator, so the generator's latency figures can be set beside
wrk's. Results: OUT (default perf/<date>-send-lag) with summary.md.

usage: scripts/bench/send-lag.py   (env: DUR=10s RATES="2000 5000 10000"
       SPINS="100us 0" ROUNDS=1; BEFORE_BIN=dir runs that build's hivenet-bench in
       the same rounds, row after row, labelled "before")
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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from lib import free_port  # noqa: E402
os.chdir(ROOT)
DUR = os.environ.get("DUR", "10s")
RATES = [int(r) for r in os.environ.get("RATES", "2000 5000 10000").split()]
SPINS = os.environ.get("SPINS", "100us 0").split()
OUT = os.environ.get("OUT", f"perf/{datetime.now(timezone.utc):%Y-%m-%d}-send-lag")
BIN = os.path.join(ROOT, "target/release")
BEFORE_BIN = os.environ.get("BEFORE_BIN")
# The p99 of a 10 s run moves by 10x between runs on a noisy VM (a
# descheduled vCPU): repeat the set and report each build's median.
ROUNDS = int(os.environ.get("ROUNDS", "1"))
BUILDS = [("now", BIN)] + ([("before", BEFORE_BIN)] if BEFORE_BIN else [])


def sh(cmd):
    return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()


def run_timed(args, **kw):
    """Run to the end; return (stdout, user+system CPU seconds)."""
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        sys.exit(f"{args[0]} failed ({p.returncode}): {out}")
    return out, ru.ru_utime + ru.ru_stime


def cpu_jitter():
    """One line on how steady CPU 0 is now (scripts/bench/cpu-jitter.c)."""
    exe = os.path.join(ROOT, "target/cpu-jitter")
    if subprocess.run(["cc", "-O1", "-o", exe, os.path.join(ROOT, "scripts/bench/cpu-jitter.c")]).returncode != 0:
        return "cpu-jitter: not built"
    return sh(f"taskset -c 0 {exe} 3")


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
        if BEFORE_BIN:
            f.write(f"before: {BEFORE_BIN}\n")
        f.write(f"cmd: {'ROUNDS=' + str(ROUNDS) + ' ' if ROUNDS > 1 else ''}{'BEFORE_BIN=' + BEFORE_BIN + ' ' if BEFORE_BIN else ''}DUR={DUR} RATES=\"{' '.join(map(str, RATES))}\" SPINS=\"{' '.join(SPINS)}\" scripts/bench/send-lag.py\n")
    jitter = [cpu_jitter()]
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
        for rnd, rate, (arr, spin) in [(n, r, x) for n in range(ROUNDS) for r in RATES for x in runs]:
                for build, bdir in BUILDS:
                    name = f"open-{rate}-{arr}-spin-{spin}-{build}-r{rnd}"
                    js = f"{OUT}/reports/{name}.json"
                    _, cpu = run_timed([f"{bdir}/hivenet-bench", "--url", url, "--rate", str(rate),
                                        "--arrivals", arr, "--duration", DUR, "--cpus", "0",
                                        "--spin", spin, "--quiet", "--max-tokens", "16", "--out", js])
                    r = json.load(open(js))
                    rows.append((rate, arr, spin, build, r, cpu / r["elapsed_s"], rnd))
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
    jitter.append(cpu_jitter())
    with open(f"{OUT}/env.txt", "a") as f:
        f.write("".join(f"{j} ({when})\n" for j, when in zip(jitter, ["before the runs", "after"])))

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
        f"`{[l for l in open(f'{OUT}/env.txt').read().splitlines() if l.startswith('cmd: ')][0][5:]}`; machine and commit in env.txt.",
        "hivenet-bench (1 worker thread, CPU 0) in open loop straight at hivenet-sim (CPU 1,",
        "non-streaming chat, 16 tokens). Send lag = start of the request's send system call",
        "minus its intended time (--spin 0: timerfd wake-up only, no busy wait); service =",
        "send to response end; bench CPU = the generator's user+system seconds per second.",
        "",
        "The machine's steadiness (a fixed ~20 us piece of work timed back to back on CPU 0,",
        "scripts/bench/cpu-jitter.c), before and after the runs:",
        "",
        *[f"- {j}" for j in jitter],
        "",
        "| rate (req/s) | arrivals | --spin | build | achieved | send lag p50 (us) | p99 (us) | p99.9 (us) | max (us) | service p50 (us) | bench CPU (cores) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate, arr, spin, build, r, cores, rnd in rows:
        s, v = r["send_lag"], r["service"]
        lines.append(f"| {rate} | {arr} | {spin} | {build}{f' r{rnd}' if ROUNDS > 1 else ''} | {r['achieved_rps']:.0f} | {s['p50']*1000:.0f} | {s['p99']*1000:.0f} | "
                     f"{s['p999']*1000:.0f} | {s['max']*1000:.0f} | {v['p50']*1000:.0f} | {cores:.2f} |")
    if ROUNDS > 1:
        lines += ["", f"Per build over {ROUNDS} rounds (send lag p99 in us: median, and each round's, in order):", "",
                  "| rate (req/s) | arrivals | --spin | build | p99 median | p99 per round | rounds under 20 us |",
                  "|---|---|---|---|---|---|---|"]
        keys = []
        for row in rows:
            if row[:4] not in keys:
                keys.append(row[:4])
        for k in keys:
            p99 = [row[4]["send_lag"]["p99"] * 1000 for row in rows if row[:4] == k]
            med = sorted(p99)[len(p99) // 2]
            under = sum(1 for x in p99 if x < 20)
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {med:.0f} | {', '.join(f'{x:.0f}' for x in p99)} | {under}/{len(p99)} |")
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
