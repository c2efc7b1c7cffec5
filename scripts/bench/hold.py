#!/usr/bin/env python3
"""Held requests at scale (issue 13's targets), against a release router:

1. hold N streaming requests with ~200-byte bodies for a model at zero,
   keepalives every second; measure the router's RSS (VmRSS) and how late
   each keepalive arrives against its due time (hold start + k x period);
2. register one agent of capacity C (a sim with no think time) and
   measure, per request, when its first data event arrives after the
   registration: all answered? the first C by hold order within 1 s? how
   far from FIFO (hold order vs order of first data)?

usage: scripts/bench/hold.py --router-bin target/release [--held N] [--hold-seconds S] [--capacity C] [--client python|rust] [--out DIR]

--client rust (default) drives the requests from `hivenet-hold-bench` (one
Rust thread); --client python from this script's asyncio loop, which
saturates near 18,000 held requests and then adds its own lateness.
Prints a summary and writes it (JSON and text) to --out.
"""
import argparse
import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from lib import cpu_s, free_port, metric, rss_kib  # noqa: E402


async def held_request(i, port, body, period, stats, t_register):
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
    except OSError as e:
        stats["connect_errors"] += 1
        return
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    start = time.monotonic()
    stats["start"][i] = start
    w.write(head + body)
    await w.drain()
    k = 0
    seen = []
    try:
        while True:
            line = await r.readline()
            if not line:
                stats["closed"] += 1
                if len(stats.setdefault("closed_samples", [])) < 5:
                    stats["closed_samples"].append(b"|".join(seen[-4:]).decode(errors="replace"))
                return
            if not line.startswith(b": keep-alive") and line.strip():
                seen.append(line.strip()[:200])
            now = time.monotonic()
            if line.startswith(b": keep-alive"):
                k += 1
                due = start + k * period
                stats["late"].append(now - due)
            elif line.startswith(b"data: {"):
                stats["first_data"][i] = now
                # Drain the rest of the stream.
                while True:
                    more = await r.readline()
                    if not more or more.startswith(b"data: [DONE]"):
                        break
                stats["served"] += 1
                w.close()
                return
    except (ConnectionError, asyncio.IncompleteReadError):
        stats["closed"] += 1


async def main_async(a, port, metrics_port, router_pid, work):
    body = json.dumps({"model": "zero-model", "stream": True, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "x" * 120}]}).encode()
    stats = {"late": [], "start": {}, "first_data": {}, "served": 0, "closed": 0, "connect_errors": 0}
    rss_before = rss_kib(router_pid)
    tasks = []
    for i in range(a.held):
        tasks.append(asyncio.create_task(held_request(i, port, body, a.keepalive, stats, None)))
        if i % 500 == 499:
            await asyncio.sleep(0.05)
    t_all = time.monotonic()
    while metric(metrics_port, 'hivenet_pending_demand{model="zero-model"}') != a.held:
        await asyncio.sleep(0.5)
        if time.monotonic() - t_all > 120:
            break
    held = metric(metrics_port, 'hivenet_pending_demand{model="zero-model"}')
    await asyncio.sleep(a.hold_seconds)
    rss_held = rss_kib(router_pid)
    late = sorted(stats["late"])
    # Register one agent: the held requests are released.
    sim_port = free_port()
    sim = subprocess.Popen([os.path.join(a.router_bin, "hivenet-sim"), "--port", str(sim_port), "--model", "zero-model",
                            "--output-tokens", "2", "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    t_reg_guess = time.monotonic()
    agent = subprocess.Popen([os.path.join(a.router_bin, "hivenet-agent"), "--router-p2p", f"/ip4/127.0.0.1/tcp/{a.p2p}",
                              "--backend-url", f"http://127.0.0.1:{sim_port}", "--identity-path", os.path.join(work, "a.key"),
                              "--capacity", str(a.capacity)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
    except asyncio.TimeoutError:
        pass
    agent.kill()
    sim.kill()
    # The registration instant: the earliest first data (no think time) is
    # an upper bound for it; the agent's spawn a lower one.
    firsts = stats["first_data"]
    order = sorted(range(a.held), key=lambda i: stats["start"].get(i, 0))
    t_first = min(firsts.values()) if firsts else None
    first_c = [firsts.get(i) for i in order[: a.capacity]]
    within = sum(1 for t in first_c if t is not None and t - t_first <= 1.0) if t_first else 0
    by_data = sorted(firsts, key=lambda i: firsts[i])
    rank = {i: n for n, i in enumerate(order)}
    # Displacement from FIFO: how far (in hold-order ranks) each request's
    # first data is from its place, in units of the capacity (a request
    # served in the same "wave" as its place counts 0).
    waves_off = [abs(rank[i] // a.capacity - n // a.capacity) for n, i in enumerate(by_data)]
    out = {
        "held": a.held,
        "held_counted_in_demand": held,
        "router_rss_kib_before": rss_before,
        "router_rss_kib_held": rss_held,
        "rss_per_held_kib": (rss_held - rss_before) / max(1, a.held),
        "keepalives": len(late),
        "keepalive_late_p50_ms": 1000 * late[len(late) // 2] if late else None,
        "keepalive_late_p99_ms": 1000 * late[int(len(late) * 0.99)] if late else None,
        "keepalive_late_max_ms": 1000 * late[-1] if late else None,
        "keepalives_later_than_1s": sum(1 for x in late if x > 1.0),
        "served": stats["served"],
        "closed_without_data": stats["closed"],
        "closed_samples": stats.get("closed_samples", []),
        "connect_errors": stats["connect_errors"],
        "agent_spawned_to_first_data_s": (t_first - t_reg_guess) if t_first else None,
        "first_capacity_within_1s_of_first_data": within,
        "capacity": a.capacity,
        "fifo_waves_off_max": max(waves_off) if waves_off else None,
        "fifo_waves_off_mean": (sum(waves_off) / len(waves_off)) if waves_off else None,
        "last_data_after_first_s": (max(firsts.values()) - t_first) if firsts else None,
    }
    return out


def start_agent(a, work):
    sim_port = free_port()
    sim = subprocess.Popen([os.path.join(a.router_bin, "hivenet-sim"), "--port", str(sim_port), "--model", "zero-model",
                            "--output-tokens", "2", "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    agent = subprocess.Popen([os.path.join(a.router_bin, "hivenet-agent"), "--router-p2p", f"/ip4/127.0.0.1/tcp/{a.p2p}",
                              "--backend-url", f"http://127.0.0.1:{sim_port}", "--identity-path", os.path.join(work, "a.key"),
                              "--capacity", str(a.capacity)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return sim, agent


def run_rust(a, port, metrics_port, router_pid, work):
    """The same measurement with the Rust client (module doc of bench::hold_client)."""
    rss_before = rss_kib(router_pid)
    client = subprocess.Popen([os.path.join(a.router_bin, "hivenet-hold-bench"), "--addr", f"127.0.0.1:{port}",
                               "--held", str(a.held), "--keepalive", f"{a.keepalive}s",
                               "--hold-seconds", f"{a.hold_seconds}s"], stdout=subprocess.PIPE, text=True)
    lines = iter(client.stdout.readline, "")
    line = next(lines, "")
    assert line.startswith("SENT"), line
    cpu_sent, t_sent = cpu_s(router_pid), time.monotonic()
    held = metric(metrics_port, 'hivenet_pending_demand{model="zero-model"}')
    for _ in range(240):
        if held == a.held:
            break
        time.sleep(0.5)
        held = metric(metrics_port, 'hivenet_pending_demand{model="zero-model"}')
    line = next(lines, "")
    assert line.startswith("HOLD_DONE "), line
    both = json.loads(line.split(" ", 1)[1])
    kfig, gfig = both["from_send"], both["from_previous"]
    rss_held = rss_kib(router_pid)
    cpu_held = (cpu_s(router_pid) - cpu_sent) / (time.monotonic() - t_sent)
    sim, agent = start_agent(a, work)
    line = next(lines, "")
    client.wait(timeout=60)
    agent.kill()
    sim.kill()
    assert line.startswith("RESULT "), line
    res = json.loads(line.split(" ", 1)[1])
    rel = res["release"]
    t = rel["first_data_s_by_hold_order"]
    got = [x for x in t if x is not None]
    within = sum(1 for x in t[: a.capacity] if x is not None and x <= 1.0)
    by_data = sorted((x, rank) for rank, x in enumerate(t) if x is not None)
    waves_off = [abs(rank // a.capacity - n // a.capacity) for n, (_, rank) in enumerate(by_data)]
    return {
        "client": "rust",
        "held": a.held,
        "held_counted_in_demand": held,
        "router_rss_kib_before": rss_before,
        "router_rss_kib_held": rss_held,
        "rss_per_held_kib": (rss_held - rss_before) / max(1, a.held),
        "router_cpu_while_held": cpu_held,
        "keepalives": kfig["keepalives"],
        "keepalive_late_p50_ms": kfig["late_p50_ms"],
        "keepalive_late_p99_ms": kfig["late_p99_ms"],
        "keepalive_late_max_ms": kfig["late_max_ms"],
        "keepalives_later_than_1s": kfig["later_than_1s"],
        "keepalive_gap_late_p50_ms": gfig["late_p50_ms"],
        "keepalive_gap_late_p99_ms": gfig["late_p99_ms"],
        "keepalive_gap_late_max_ms": gfig["late_max_ms"],
        "keepalive_gaps_later_than_1s": gfig["later_than_1s"],
        "late_gaps_by_second": both["late_gaps_by_second"],
        "keepalives_after_release": res["keepalives_after_release"],
        "keepalive_gaps_after_release": res["keepalive_gaps_after_release"],
        "served": rel["served"],
        "closed_without_data": rel["closed_without_data"],
        "connect_errors": rel["connect_errors"],
        "first_capacity_within_1s_of_first_data": within,
        "capacity": a.capacity,
        "fifo_waves_off_max": max(waves_off) if waves_off else None,
        "fifo_waves_off_mean": (sum(waves_off) / len(waves_off)) if waves_off else None,
        "last_data_after_first_s": max(got) if got else None,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--router-bin", default="target/release")
    ap.add_argument("--held", type=int, default=10000)
    ap.add_argument("--hold-seconds", type=float, default=10)
    ap.add_argument("--keepalive", type=float, default=1.0)
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--client", choices=["rust", "python"], default="rust")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.router_bin = os.path.abspath(a.router_bin)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    work = tempfile.mkdtemp(prefix="hivenet-hold-bench-")
    port, metrics_port, a.p2p = free_port(), free_port(), free_port()
    env = dict(os.environ, HIVENET_ROUTER_ADMIN_API_KEYS="bench-admin", RUST_LOG="warn")
    router = subprocess.Popen([os.path.join(a.router_bin, "hivenet-router"), "--http-port", f"127.0.0.1:{port}",
                               "--metrics-port", f"127.0.0.1:{metrics_port}", "--p2p-port", str(a.p2p),
                               "--shards", str(a.shards), "--site-id", "a", "--wake-keepalive", f"{a.keepalive}s",
                               "--wake-hold-max-per-key", "1000000", "--wake-hold-max-per-model", "1000000",
                               "--max-client-connections", "0", "--queue-depth", "30"],
                              cwd=work, env=env, stdout=open(os.path.join(work, "router.log"), "w"), stderr=subprocess.STDOUT)
    for _ in range(200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            break
        except Exception:
            time.sleep(0.05)
    m = {"version": "1", "sites": [{"site_id": "a", "base_url": f"http://127.0.0.1:{port}"}],
         "placements": [{"site_id": "a", "model": "zero-model", "kind": "chat", "scale_from_zero": True, "hold_budget": "1h"}]}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/admin/sibling-map", data=json.dumps(m).encode(), method="PUT",
                                 headers={"Authorization": "Bearer bench-admin"})
    urllib.request.urlopen(req, timeout=5)
    try:
        if a.client == "rust":
            out = run_rust(a, port, metrics_port, router.pid, work)
        else:
            out = asyncio.run(main_async(a, port, metrics_port, router.pid, work))
    finally:
        router.kill()
    out["nofile_limit"] = hard
    text = "\n".join(f"{k}: {v}" for k, v in out.items())
    print(text)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"hold-{a.held}-{a.client}.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
