#!/usr/bin/env python3
"""The router replaced under load (issue 54), against a release build:

- STREAMS streamed chats in flight all the time (hivenet-bench, closed
  loop, one connection each, keep-alive): its per-second histograms of the
  gap between tokens show what the switch adds;
- HELD requests held at zero (hivenet-hold-bench, keepalives every
  second, timed against their schedule across the switch), released by an
  agent registered after the switch;
- a client opening a new connection every 20 ms (refused or failed ones
  counted) and the pending demand scraped every 20 ms (never above HELD);

then `hivenet-router --upgrade` replaces the running router at SWITCH_AT
seconds. Prints the figures and writes them to --out.

With --kill-mid, a replacement is killed (SIGKILL) first, once it holds
the sockets and the store (its log says so), in the middle of the
hand-over: the old router must take its store back and serve on. With
--drain S, the old router's --upgrade-drain-timeout is S seconds: the
streams it still relays then go to the new process, which continues them.

usage: scripts/bench/upgrade.py --bin target/release [--streams 1000] [--held 10000] [--out DIR]
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from lib import free_port, http_request, metric, rss_kib, wait_until  # noqa: E402

ADMIN = "bench-admin"


def router(a, work, ports, upgrade, tag, extra=()):
    args = [os.path.join(a.bin, "hivenet-router"), "--http-port", f"127.0.0.1:{ports[0]}",
            "--metrics-port", f"127.0.0.1:{ports[1]}", "--p2p-port", str(ports[2]),
            "--shards", "2", "--site-id", "a", "--wake-keepalive", "1s",
            "--wake-hold-max-per-key", "1000000", "--wake-hold-max-per-model", "1000000",
            "--max-client-connections", "0", "--queue-depth", "4096", "--header-timeout", "5s"]
    if upgrade:
        args.append("--upgrade")
    args.extend(extra)
    env = dict(os.environ, HIVENET_ROUTER_ADMIN_API_KEYS=ADMIN, RUST_LOG="info",
               HIVENET_ROUTER_AUDIT_LOG_PATH="off")
    return subprocess.Popen(args, cwd=work, env=env, stdout=open(os.path.join(work, f"{tag}.log"), "w"),
                            stderr=subprocess.STDOUT)


def sim_and_agent(a, work, p2p, model, key, sim_args, capacity):
    port = free_port()
    sim = subprocess.Popen([os.path.join(a.bin, "hivenet-sim"), "--port", str(port), "--model", model] + sim_args,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    agent = subprocess.Popen([os.path.join(a.bin, "hivenet-agent"), "--router-p2p", f"/ip4/127.0.0.1/tcp/{p2p}",
                              "--backend-url", f"http://127.0.0.1:{port}", "--identity-path", os.path.join(work, key),
                              "--capacity", str(capacity)],
                             stdout=open(os.path.join(work, f"{key}.log"), "w"), stderr=subprocess.STDOUT)
    return [sim, agent]


def opener(port, stop, out):
    """A new connection every 20 ms, a short chat on it; failures counted."""
    body = json.dumps({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).encode()
    while not stop.is_set():
        try:
            status, _ = http_request(port, "POST", "/v1/chat/completions", body, timeout=30,
                                     headers="Content-Type: application/json\r\n")
        except OSError as e:
            status = f"{type(e).__name__}"
        out.append(status)
        time.sleep(0.02)


def scraper(port, stop, out):
    while not stop.is_set():
        try:
            d = metric(port, 'hivenet_pending_demand{model="zero-model"}')
            if d is not None:
                out.append(d)
        except OSError:
            out.append(-1)
        time.sleep(0.02)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release")
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--held", type=int, default=10000)
    ap.add_argument("--itl-ms", type=int, default=100)
    # A range: streams end at different times (one wave of 1,000 streams
    # ending together stalls the sim and the client themselves, router or
    # not: perf/2026-12-05-upgrade/notes.md).
    ap.add_argument("--tokens", default="30-90")
    ap.add_argument("--duration", type=int, default=40)
    ap.add_argument("--switch-at", type=int, default=15)
    ap.add_argument("--no-switch", action="store_true", help="the same load without the upgrade (the baseline)")
    ap.add_argument("--fail-first", action="store_true",
                    help="5 s before the upgrade, a replacement with a bad flag (it must exit 2, the old router untouched)")
    ap.add_argument("--kill-mid", action="store_true",
                    help="5 s before the upgrade, a replacement killed once it holds the sockets and the store")
    ap.add_argument("--drain", type=float, default=0,
                    help="the old router's --upgrade-drain-timeout in seconds (0: the default, 10m)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    drain = ["--upgrade-drain-timeout", f"{int(a.drain * 1000)}ms"] if a.drain else []
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    work = tempfile.mkdtemp(prefix="hivenet-upgrade-bench-")
    ports = (free_port(), free_port(), free_port())
    procs = []
    old = router(a, work, ports, False, "router-old", drain)
    wait_until(lambda: urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/health", timeout=1).status == 200, "router")
    m = {"version": "1", "sites": [{"site_id": "a", "base_url": f"http://127.0.0.1:{ports[0]}"}],
         "placements": [{"site_id": "a", "model": "zero-model", "kind": "chat", "scale_from_zero": True,
                         "hold_budget": "1h"}]}
    req = urllib.request.Request(f"http://127.0.0.1:{ports[0]}/admin/sibling-map", data=json.dumps(m).encode(),
                                 method="PUT", headers={"Authorization": f"Bearer {ADMIN}"})
    urllib.request.urlopen(req, timeout=5)
    # Two engines for the streams, each taking half of them and more.
    cap = a.streams // 2 + 64
    sim_args = ["--itl", f"{a.itl_ms}ms", "--output-tokens", "1000", "--threads", "1"]
    procs += sim_and_agent(a, work, ports[2], "m", "m1.key", sim_args, cap)
    procs += sim_and_agent(a, work, ports[2], "m", "m2.key", sim_args, cap)
    wait_until(lambda: b'"healthy":2' in urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/v1/models").read(),
               "two agents", 30)
    hold = subprocess.Popen([os.path.join(a.bin, "hivenet-hold-bench"), "--addr", f"127.0.0.1:{ports[0]}",
                             "--model", "zero-model", "--held", str(a.held), "--keepalive", "1s",
                             "--hold-seconds", f"{a.duration + 10}s"], stdout=subprocess.PIPE, text=True)
    lines = iter(hold.stdout.readline, "")
    line = next(lines, "")
    assert line.startswith("SENT"), line
    wait_until(lambda: metric(ports[1], 'hivenet_pending_demand{model="zero-model"}') == a.held, "held", 120)
    stop = threading.Event()
    opened, demand = [], []
    threads = [threading.Thread(target=opener, args=(ports[0], stop, opened)),
               threading.Thread(target=scraper, args=(ports[1], stop, demand))]
    for t in threads:
        t.start()
    report = os.path.join(work, "bench.json")
    bench = subprocess.Popen([os.path.join(a.bin, "hivenet-bench"), "--url", f"http://127.0.0.1:{ports[0]}",
                              "--connections", str(a.streams), "--duration", f"{a.duration}s", "--stream",
                              "--model", "m", "--max-tokens", str(a.tokens), "--timeout", "120s",
                              "--out", report], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t_bench = time.monotonic()
    failed = None
    if a.fail_first:
        time.sleep(max(0, a.switch_at - 5))
        bad = router(a, work, ports, True, "router-bad", ["--wake-keepalive", "often"])
        failed = {"at_s": round(time.monotonic() - t_bench, 2), "exit": bad.wait(timeout=30),
                  "old_alive": old.poll() is None}
        time.sleep(max(0, a.switch_at - (time.monotonic() - t_bench)))
    elif a.kill_mid:
        time.sleep(max(0, a.switch_at - 5))
        mid = router(a, work, ports, True, "router-mid")
        log = os.path.join(work, "router-mid.log")
        t_mid = time.monotonic()
        while time.monotonic() - t_mid < 30 and "the store is ours" not in open(log).read():
            time.sleep(0.002)
        mid.kill()
        mid.wait()
        time.sleep(1)
        old_log = open(os.path.join(work, "router-old.log")).read()
        failed = {"at_s": round(time.monotonic() - t_bench, 2), "killed_after_s": round(time.monotonic() - t_mid, 2),
                  "old_alive": old.poll() is None,
                  "old_abandoned": [l.split("WARN ")[-1] for l in old_log.splitlines() if "abandoned" in l][-2:]}
        time.sleep(max(0, a.switch_at - (time.monotonic() - t_bench)))
    else:
        time.sleep(a.switch_at)
    rss_old = rss_kib(old.pid)
    t_switch = time.monotonic() - t_bench
    if a.no_switch:
        new, old_rc, t_old_gone = old, None, None
    else:
        new = router(a, work, ports, True, "router-new", drain)
        old_rc = old.wait(timeout=a.duration + 600)
        t_old_gone = round(time.monotonic() - t_bench, 2)
    out_bench, _ = bench.communicate(timeout=a.duration + 300)
    stop.set()
    for t in threads:
        t.join()
    line = next(lines, "")
    assert line.startswith("HOLD_DONE "), line
    both = json.loads(line.split(" ", 1)[1])
    procs += sim_and_agent(a, work, ports[2], "zero-model", "z.key", ["--output-tokens", "2", "--threads", "1"], 256)
    line = next(lines, "")
    hold.wait(timeout=300)
    assert line.startswith("RESULT "), line
    res = json.loads(line.split(" ", 1)[1])
    r = json.load(open(report))
    by_s = r.get("content_gap_by_second", [])
    sw = int(t_switch)
    around = [s for s in by_s if sw - 1 <= s["t"] <= sw + 2]
    others = sorted(s["p99"] for s in by_s if s["count"] > 0 and not (sw - 1 <= s["t"] <= sw + 2) and s["t"] > 2)
    base_p99 = others[len(others) // 2] if others else None
    old_log = open(os.path.join(work, "router-old.log")).read()
    handed = [l for l in old_log.splitlines() if "handed over" in l]
    new_log = open(os.path.join(work, "router-new.log")).read() if not a.no_switch else ""
    carried = [l for l in old_log.splitlines() if "go to the new process" in l]
    summary = {
        "streams": a.streams, "held": a.held, "itl_ms": a.itl_ms, "tokens": a.tokens,
        "switch_at_s": round(t_switch, 2), "failed_replacement": failed, "old_exit_code": old_rc, "old_gone_at_s": t_old_gone, "switched": not a.no_switch,
        "old_rss_kib_before_switch": rss_old,
        "streams_sent": r["sent"], "streams_ok": r["ok"], "stream_errors": r["errors"],
        "stream_errors_by_code": r["errors_by_code"],
        "content_gap_p99_ms_switch_seconds": [(s["t"], s["p99"], s["max"]) for s in around],
        "content_gap_p99_ms_median_other_seconds": base_p99,
        "added_gap_p99_ms": (max(s["p99"] for s in around) - base_p99) if around and base_p99 is not None else None,
        "content_gap_whole_run": r["content_gap"],
        "connections_opened": len(opened), "connections_failed": sum(1 for s in opened if s != 200),
        "connection_failures": sorted({str(s) for s in opened if s != 200}),
        "pending_demand_max": max(demand) if demand else None, "pending_demand_samples": len(demand),
        "held_served": res["release"]["served"], "held_closed_without_data": res["release"]["closed_without_data"],
        "held_connect_errors": res["release"]["connect_errors"],
        "held_cut": res["release"].get("cut"), "held_cut_tails": res["release"].get("cut_tails"),
        "keepalive_gap_late_p99_ms": both["from_previous"]["late_p99_ms"],
        "keepalive_gap_late_max_ms": both["from_previous"]["late_max_ms"],
        "keepalive_late_gaps_by_second": both["late_gaps_by_second"],
        "old_router_handed_over": handed[-1].split("INFO ")[-1] if handed else None,
        "drain_s": a.drain or None,
        "streams_carried_at_drain": carried[-1].split("INFO ")[-1] if carried else None,
        "streams_continued_by_new": new_log.count("relayed until its drain timeout continued here"),
        "held_early": res.get("early"),
        "held_wall_s": round(time.monotonic() - t_bench, 1),
    }
    text = "\n".join(f"{k}: {v}" for k, v in summary.items())
    print(text)
    print(out_bench[-2000:])
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        tag = f"{a.streams}-{a.held}" + ("-noswitch" if a.no_switch else "") + ("-killmid" if a.kill_mid else "") \
            + (f"-drain{a.drain:g}s" if a.drain else "")
        with open(os.path.join(a.out, f"upgrade-{tag}.json"), "w") as f:
            json.dump(summary, f, indent=1)
        with open(os.path.join(a.out, f"upgrade-{tag}-gaps.json"), "w") as f:
            json.dump([[s["t"], s["count"], s["p50"], s["p99"], s["max"]] for s in by_s], f)
    for p in procs + [new]:
        p.kill()


if __name__ == "__main__":
    main()
