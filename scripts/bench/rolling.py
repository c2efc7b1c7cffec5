#!/usr/bin/env python3
"""A Kubernetes-style rolling replacement under load (issue 54), full size,
against a release build: two routers A and B share a real Redis
(`--shared-state`), every agent links to both, and clients reach them
through `hivenet-service` (a Service: each new connection to the next
endpoint; the endpoints file is what the endpoints controller keeps).
Three of them share the endpoints file, as kube-proxy runs on every node:
a proxied connection costs two descriptors and a process may have 20,000
here, so the held requests come through two "nodes" (two
hivenet-hold-bench of HELD/2 each) and the streams and the opener through
a third.

- STREAMS streamed chats in flight all the time (hivenet-bench through the
  Service, closed loop, keep-alive connections);
- HELD requests held at zero through the Service (hivenet-hold-bench),
  some on each router, woken WAKE_AFTER seconds after A's SIGTERM by an
  agent of the model linked to both;
- a new connection every 20 ms through the Service (failures counted), the
  fleet's pending demand (A's + B's, the KEDA sum) scraped every 20 ms.

At SWITCH_AT the StatefulSet deletes pod A: A leaves the endpoints, its
preStop sleeps 5 s, SIGTERM; A drains (its keep-alive clients told
`Connection: close`, its held requests kept until their wake) and exits;
A' starts on A's address and volume (the same ports and store), joins the
endpoints once its `/ready` answers 200. Prints the figures and writes them
to --out.

usage: scripts/bench/rolling.py --bin $PWD/target/release [--streams 1000] [--held 10000] [--out DIR]
"""
import argparse
import atexit
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from lib import free_port, metric, wait_until  # noqa: E402
import upgrade as up  # noqa: E402

# Every process started here is killed when the script ends, however.
_CHILDREN = []


class _Tracked(subprocess.Popen):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        _CHILDREN.append(self)


subprocess.Popen = _Tracked
atexit.register(lambda: [c.kill() for c in _CHILDREN if c.poll() is None])


def ready(port):
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1).status == 200
    except OSError:
        return False


def agent_to_both(a, work, routers, model, key, sim_args, capacity):
    port = free_port()
    sim = subprocess.Popen([os.path.join(a.bin, "hivenet-sim"), "--port", str(port), "--model", model] + sim_args,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    args = [os.path.join(a.bin, "hivenet-agent")]
    for p2p in routers:
        args += ["--router-p2p", f"/ip4/127.0.0.1/tcp/{p2p}"]
    args += ["--backend-url", f"http://127.0.0.1:{port}", "--identity-path", os.path.join(work, key),
             "--capacity", str(capacity)]
    agent = subprocess.Popen(args, stdout=open(os.path.join(work, f"{key}.log"), "w"), stderr=subprocess.STDOUT)
    return [sim, agent]


def put_map(http, base_url):
    m = {"version": "1", "sites": [{"site_id": "a", "base_url": base_url}],
         "placements": [{"site_id": "a", "model": "zero-model", "kind": "chat", "scale_from_zero": True,
                         "hold_budget": "1h"}]}
    req = urllib.request.Request(f"http://127.0.0.1:{http}/admin/sibling-map", data=json.dumps(m).encode(),
                                 method="PUT", headers={"Authorization": f"Bearer {up.ADMIN}"})
    urllib.request.urlopen(req, timeout=5)


def demand_scraper(ports, stop, out):
    """The fleet's pending demand: the sum over the routers up (KEDA's)."""
    while not stop.is_set():
        total = 0.0
        for p in ports:
            try:
                total += metric(p, 'hivenet_pending_demand{model="zero-model"}') or 0.0
            except OSError:
                pass
        out.append((time.monotonic(), total))
        time.sleep(0.02)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release")
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--held", type=int, default=10000)
    ap.add_argument("--itl-ms", type=int, default=100)
    ap.add_argument("--tokens", default="30-90")
    ap.add_argument("--duration", type=int, default=60)
    ap.add_argument("--switch-at", type=int, default=15)
    ap.add_argument("--wake-after", type=int, default=10, help="seconds after A's SIGTERM")
    ap.add_argument("--no-switch", action="store_true",
                    help="the same load and wake without the replacement (the baseline)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    work = tempfile.mkdtemp(prefix="hivenet-rolling-bench-")
    wa, wb = os.path.join(work, "a"), os.path.join(work, "b")
    os.makedirs(wa)
    os.makedirs(wb)
    redis_port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no"], cwd=work, stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    shared = ["--shared-state", f"redis://127.0.0.1:{redis_port}/0", "--drain-timeout", "300s"]
    pa = (free_port(), free_port(), free_port())
    pb = (free_port(), free_port(), free_port())
    ra = up.router(a, wa, pa, False, "router-a", shared)
    rb = up.router(a, wb, pb, False, "router-b", shared)
    for p in (pa, pb):
        wait_until(lambda: ready(p[0]), "router", 30)
    endpoints = os.path.join(work, "endpoints")

    def set_endpoints(ports):
        with open(endpoints + ".tmp", "w") as f:
            f.write("".join(f"127.0.0.1:{p}\n" for p in ports))
        os.replace(endpoints + ".tmp", endpoints)

    set_endpoints([pa[0], pb[0]])

    def service():
        port = free_port()
        svc = subprocess.Popen([os.path.join(a.bin, "hivenet-service"), "--listen", f"127.0.0.1:{port}",
                                "--endpoints-file", endpoints], stdout=subprocess.PIPE, text=True)
        out = []
        threading.Thread(target=lambda: [out.append(l) for l in iter(svc.stdout.readline, "")],
                         daemon=True).start()
        wait_until(lambda: any(l.startswith("LISTENING") for l in out), "service", 10)
        return svc, port, out

    services = [service() for _ in range(3)]
    svc_port = services[2][1]
    for p in (pa, pb):
        put_map(p[0], f"http://127.0.0.1:{svc_port}")
    procs = [redis] + [s[0] for s in services]
    cap = a.streams // 2 + 64
    sim_args = ["--itl", f"{a.itl_ms}ms", "--output-tokens", "1000", "--threads", "1"]
    procs += agent_to_both(a, work, [pa[2], pb[2]], "m", "m1.key", sim_args, cap)
    procs += agent_to_both(a, work, [pa[2], pb[2]], "m", "m2.key", sim_args, cap)
    for p in (pa, pb):
        wait_until(lambda: b'"healthy":2' in urllib.request.urlopen(f"http://127.0.0.1:{p[0]}/v1/models").read(),
                   "two agents", 30)
    hold_s = a.switch_at + 5 + a.wake_after
    holds = [subprocess.Popen([os.path.join(a.bin, "hivenet-hold-bench"), "--addr", f"127.0.0.1:{services[k][1]}",
                               "--model", "zero-model", "--held", str(a.held // 2), "--keepalive", "1s",
                               "--hold-seconds", f"{hold_s}s"], stdout=subprocess.PIPE, text=True)
             for k in range(2)]
    lines = [iter(h.stdout.readline, "") for h in holds]
    for ls in lines:
        line = next(ls, "")
        assert line.startswith("SENT"), line
    both_demand = lambda: sum(metric(p[1], 'hivenet_pending_demand{model="zero-model"}') or 0 for p in (pa, pb))
    wait_until(lambda: both_demand() == a.held, "held", 120)
    held_on_a = metric(pa[1], 'hivenet_pending_demand{model="zero-model"}')
    stop = threading.Event()
    opened, demand = [], []
    threads = [threading.Thread(target=up.opener, args=(svc_port, stop, opened)),
               threading.Thread(target=demand_scraper, args=((pa[1], pb[1]), stop, demand))]
    for t in threads:
        t.start()
    report = os.path.join(work, "bench.json")
    bench = subprocess.Popen([os.path.join(a.bin, "hivenet-bench"), "--url", f"http://127.0.0.1:{svc_port}",
                              "--connections", str(a.streams), "--duration", f"{a.duration}s", "--stream",
                              "--model", "m", "--max-tokens", str(a.tokens), "--timeout", "120s",
                              "--out", report], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.monotonic()
    marks = {}
    time.sleep(a.switch_at)
    # The pod is deleted: out of the endpoints at once, preStop 5 s, SIGTERM.
    if not a.no_switch:
        set_endpoints([pb[0]])
    marks["a_out_of_endpoints_s"] = round(time.monotonic() - t0, 2)
    time.sleep(5)
    if not a.no_switch:
        ra.send_signal(15)
    marks["a_sigterm_s"] = round(time.monotonic() - t0, 2)
    keepalives = []
    for ls in lines:
        line = next(ls, "")
        assert line.startswith("HOLD_DONE "), line
        keepalives.append(json.loads(line.split(" ", 1)[1]))
    # The model at zero wakes: an agent linked to both routers.
    procs += agent_to_both(a, work, [pa[2], pb[2]], "zero-model", "z.key", ["--output-tokens", "2", "--threads", "1"],
                           256)
    marks["wake_s"] = round(time.monotonic() - t0, 2)
    if a.no_switch:
        a_rc = None
        time.sleep(11)
        marks["a2_in_endpoints_s"] = round(time.monotonic() - t0, 2)
    else:
        a_rc = ra.wait(timeout=600)
        marks["a_exit_s"] = round(time.monotonic() - t0, 2)
        # A' on A's address and volume.
        ra2 = up.router(a, wa, pa, False, "router-a2", shared)
        procs.append(ra2)
        wait_until(lambda: ready(pa[0]), "A' ready", 60)
        marks["a2_ready_s"] = round(time.monotonic() - t0, 2)
        put_map(pa[0], f"http://127.0.0.1:{svc_port}")
        set_endpoints([pa[0], pb[0]])
        marks["a2_in_endpoints_s"] = round(time.monotonic() - t0, 2)
    res = []
    for h, ls in zip(holds, lines):
        line = next(ls, "")
        h.wait(timeout=300)
        assert line.startswith("RESULT "), line
        res.append(json.loads(line.split(" ", 1)[1]))
    rel = lambda k: sum(r["release"].get(k) or 0 for r in res)
    out_bench, _ = bench.communicate(timeout=a.duration + 300)
    stop.set()
    for t in threads:
        t.join()
    r = json.load(open(report))
    by_s = r.get("content_gap_by_second", [])
    # The seconds around A's exit from the endpoints, its SIGTERM and A''s entry.
    events = [marks["a_out_of_endpoints_s"], marks["a_sigterm_s"], marks["a2_in_endpoints_s"]]
    near = lambda t: any(int(e) - 1 <= t <= int(e) + 2 for e in events)
    around = [s for s in by_s if near(s["t"]) and s["count"] > 0]
    others = sorted(s["p99"] for s in by_s if s["count"] > 0 and not near(s["t"]) and s["t"] > 2)
    base_p99 = others[len(others) // 2] if others else None
    svc_last = [json.loads(next((l for l in reversed(out) if l.startswith("SERVICE ")), "SERVICE {}").split(" ", 1)[1])
                for _, _, out in services]
    a_log = open(os.path.join(wa, "router-a.log")).read()
    summary = {
        "streams": a.streams, "held": a.held, "held_on_a_before": held_on_a, "itl_ms": a.itl_ms, "tokens": a.tokens,
        **marks, "a_exit_code": a_rc,
        "streams_sent": r["sent"], "streams_ok": r["ok"], "stream_errors": r["errors"],
        "stream_errors_by_code": r["errors_by_code"],
        "content_gap_p99_ms_event_seconds": [(s["t"], s["p99"], s["max"]) for s in around],
        "content_gap_p99_ms_median_other_seconds": base_p99,
        "added_gap_p99_ms": (max(s["p99"] for s in around) - base_p99) if around and base_p99 is not None else None,
        "content_gap_whole_run": r["content_gap"],
        "connections_opened": len(opened), "connections_failed": sum(1 for s in opened if s != 200),
        "connection_failures": sorted({str(s) for s in opened if s != 200}),
        "pending_demand_sum_max": max(d for _, d in demand) if demand else None,
        "pending_demand_samples": len(demand),
        "held_served": rel("served"), "held_closed_without_data": rel("closed_without_data"),
        "held_connect_errors": rel("connect_errors"),
        "held_cut": rel("cut"), "held_cut_tails": [t for r in res for t in r["release"].get("cut_tails") or []],
        "keepalive_gap_late_p99_ms": [k["from_previous"]["late_p99_ms"] for k in keepalives],
        "keepalive_gap_late_max_ms": [k["from_previous"]["late_max_ms"] for k in keepalives],
        "services": svc_last,
        "a_drain_lines": [l.split("INFO ")[-1] for l in a_log.splitlines()
                          if "shutting down" in l or "drain" in l.lower()][-4:],
    }
    text = "\n".join(f"{k}: {v}" for k, v in summary.items())
    print(text)
    print(out_bench[-1500:])
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        tag = f"rolling-{a.streams}-{a.held}" + ("-noswitch" if a.no_switch else "")
        with open(os.path.join(a.out, f"{tag}.json"), "w") as f:
            json.dump(summary, f, indent=1)
        with open(os.path.join(a.out, f"{tag}-gaps.json"), "w") as f:
            json.dump([[s["t"], s["count"], s["p50"], s["p99"], s["max"]] for s in by_s], f)
    for p in procs + [rb]:
        p.kill()


if __name__ == "__main__":
    main()
