"""Shared helpers of the project's Python scripts (soak, benchmarks):
free ports, processes started and stopped by PID with their logs in a
work directory, waits for HTTP, metric lines, /proc readings.

    import sys, os; sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # from scripts/bench/
    from lib import Fleet, free_port, wait_http, metric
"""
import os
import socket
import subprocess
import time
import urllib.request


def free_port():
    """A port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_request(port, method, path, body=b"", timeout=5, headers=""):
    """(status, body) of one request to http://127.0.0.1:port/path on its
    own connection (`headers`: extra header lines, each ending in CRLF)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        head = (f"{method} {path} HTTP/1.1\r\nHost: s\r\n{headers}"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        s.sendall(head.encode() + body)
        data = b""
        while True:
            d = s.recv(65536)
            if not d:
                break
            data += d
    finally:
        s.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), rest


def http_get(port, path, timeout=5):
    """(status, body) of GET http://127.0.0.1:port/path on its own connection."""
    return http_request(port, "GET", path, timeout=timeout)


def wait_until(pred, what, limit=30.0):
    """Poll `pred` every 0.1 s until it is true (connection errors count as
    false); exit with a message naming `what` after `limit` seconds."""
    t = time.time()
    while time.time() - t < limit:
        try:
            if pred():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}")


def wait_http(port, path="/health", status=200, limit=30.0):
    """Wait until GET path answers `status`."""
    wait_until(lambda: http_get(port, path)[0] == status, f"{path} on :{port}", limit)


def metric(port, prefix):
    """The value of the first /metrics line starting with `prefix` (None: absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(prefix):
                return float(line.split()[-1])
    return None


def rss_kib(pid):
    """Resident memory of a process, KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def thread_cpu_ns(pid):
    """On-CPU nanoseconds of each thread of a process so far, by thread
    name (schedstat; threads of one name summed)."""
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                ns = int(f.read().split()[0])
        except OSError:
            continue
        out[name] = out.get(name, 0) + ns
    return out


def cpu_s(pid):
    """User + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Fleet:
    """Router, simulators and agents of one run, started from `bin_dir`
    with their logs in `work`, stopped by PID (`stop`, or leaving a
    `with` block)."""

    def __init__(self, bin_dir, work, env=None):
        self.bin, self.work, self.env = bin_dir, work, env or dict(os.environ)
        self.procs = []

    def spawn(self, name, args, log_name=None):
        log = open(os.path.join(self.work, (log_name or name) + ".log"), "ab")
        p = subprocess.Popen([os.path.join(self.bin, name)] + list(args), env=self.env,
                             stdout=log, stderr=log, cwd=self.work)
        self.procs.append(p)
        return p

    def router(self, http, metrics, p2p, extra=(), log_name="router"):
        return self.spawn("hivenet-router", ["--http-port", f"127.0.0.1:{http}", "--metrics-port",
                                             f"127.0.0.1:{metrics}", "--p2p-port", str(p2p)] + list(extra), log_name)

    def sim(self, port, model, extra=(), log_name=None):
        return self.spawn("hivenet-sim", ["--port", str(port), "--model", model] + list(extra), log_name or f"sim-{port}")

    def agent(self, p2p, backend_port, identity, extra=(), log_name=None):
        return self.spawn("hivenet-agent", ["--router-p2p", f"/ip4/127.0.0.1/tcp/{p2p}", "--backend-url",
                                            f"http://127.0.0.1:{backend_port}", "--identity-path",
                                            os.path.join(self.work, identity)] + list(extra), log_name or identity)

    def stop(self, sig_timeout=5.0):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=sig_timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def routers_behind_one_agent(fleet, work, n, router_extra, sim_args, capacity, admin_key):
    """`n` routers (`--shards 1`, own store and identity, plus
    `router_extra(i)`), one hivenet-sim (`sim_args`) behind one agent of
    `capacity` linked to every router; waits until each router lists the
    agent. Returns (http ports, metrics ports, router processes, sim port)."""
    import json
    https, mets, p2ps, procs = [], [], [], []
    for i in range(n):
        h, m, p = free_port(), free_port(), free_port()
        extra = ["--shards", "1", "--disk-db-path", os.path.join(work, f"db{i}"),
                 "--identity-path", os.path.join(work, f"r{i}.key")] + list(router_extra(i))
        procs.append(fleet.router(h, m, p, extra, log_name=f"router-{i}"))
        https.append(h)
        mets.append(m)
        p2ps.append(p)
    sim = free_port()
    fleet.sim(sim, "sim-model", sim_args)
    more = []
    for p in p2ps[1:]:
        more += ["--router-p2p", f"/ip4/127.0.0.1/tcp/{p}"]
    fleet.agent(p2ps[0], sim, "agent.key", ["--capacity", str(capacity), "--warmup", "off"] + more)

    def agents(h):
        req = urllib.request.Request(f"http://127.0.0.1:{h}/admin/routing-table",
                                     headers={"Authorization": f"Bearer {admin_key}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return len(json.load(r)["agents"])
    for h in https:
        wait_until(lambda h=h: agents(h) == 1, "the agent on every router")
    return https, mets, procs, sim
