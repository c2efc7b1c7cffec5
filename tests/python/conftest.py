"""Fixtures that start real processes on loopback: hivenet-sim backends,
hivenet-router and hivenet-agent, from the cargo target directory."""
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("HIVENET_BIN_DIR", os.path.join(ROOT, "target", "debug"))


_GIVEN = set()


def free_port():
    """A free port, never the same twice in one run (our listeners use
    SO_REUSEPORT, so two of them on one port would split connections)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p not in _GIVEN:
            _GIVEN.add(p)
            return p


def get_json(url, timeout=2):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, json.loads(r.read())


def wait_until(pred, what, limit=30):
    start = time.time()
    while time.time() - start < limit:
        try:
            if pred():
                return
        except Exception:
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Fleet:
    def __init__(self, tmp):
        self.tmp = tmp
        self.procs = []

    def spawn(self, name, args, env=None):
        log = open(os.path.join(self.tmp, f"{name}-{len(self.procs)}.log"), "w")
        env = dict(os.environ, RUST_LOG="info", HIVENET_ROUTER_ADMIN_API_KEYS="test-admin-key", **(env or {}))
        p = subprocess.Popen([os.path.join(BIN, name)] + args, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp, env=env)
        p.log_path = log.name
        self.procs.append(p)
        return p

    def sim(self, model, *extra):
        port = free_port()
        p = self.spawn("hivenet-sim", ["--port", str(port), "--model", model, *extra])
        wait_until(lambda: get_json(f"http://127.0.0.1:{port}/v1/models")[0] == 200, "sim")
        p.port = port
        return p

    def router(self, *extra, env=None):
        self.http, self.metrics, self.p2p = free_port(), free_port(), free_port()
        p = self.spawn("hivenet-router", ["--http-port", f"127.0.0.1:{self.http}", "--metrics-port", f"127.0.0.1:{self.metrics}",
                                          "--p2p-port", str(self.p2p), *extra], env=env)
        wait_until(lambda: get_json(f"http://127.0.0.1:{self.http}/health")[0] == 200, "router")
        self.base = f"http://127.0.0.1:{self.http}"
        return p

    def agent(self, sim, identity, *extra):
        return self.spawn("hivenet-agent", ["--router-p2p", f"/ip4/127.0.0.1/tcp/{self.p2p}",
                                            "--backend-url", f"http://127.0.0.1:{sim.port}",
                                            "--identity-path", os.path.join(self.tmp, identity), *extra])

    def healthy(self, model):
        # The admin view: it answers whatever the client auth mode.
        req = urllib.request.Request(f"{self.base}/admin/models", headers={"Authorization": "Bearer test-admin-key"})
        with urllib.request.urlopen(req, timeout=2) as r:
            v = json.loads(r.read())
        for m in v["data"]:
            if m["id"] == model:
                return m["agents"]["healthy"]
        return 0

    def wait_agents(self, model, n):
        wait_until(lambda: self.healthy(model) >= n, f"{n} agents for {model}")

    def metrics_text(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=5) as r:
            return r.read().decode()

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def fleet():
    with tempfile.TemporaryDirectory(prefix="hivenet-py-") as tmp:
        f = Fleet(tmp)
        try:
            yield f
        finally:
            f.close()


def install_llama():
    """The engine and model the project's install script prints (built
    once, cached outside the clone)."""
    out = subprocess.run([os.path.join(ROOT, "scripts", "install-llama.sh")], check=True,
                         capture_output=True, text=True).stdout
    got = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return got["LLAMA_SERVER"], got["LLAMA_MODEL"]


class Engine:
    """A real llama-server (one thread, 2048-token context, one slot)."""

    def __init__(self, fleet, *extra):
        server, model = install_llama()
        self.port = free_port()
        log = open(os.path.join(fleet.tmp, f"llama-{self.port}.log"), "w")
        self.proc = subprocess.Popen([server, "-m", model, "--host", "127.0.0.1", "--port", str(self.port), "-t", "1",
                                      "-c", "2048", "-np", "1", "--metrics", *extra],
                                     stdout=log, stderr=subprocess.STDOUT)
        fleet.procs.append(self.proc)
        wait_until(lambda: get_json(f"http://127.0.0.1:{self.port}/health")[0] == 200, "llama-server", limit=120)
        self.base = f"http://127.0.0.1:{self.port}"
        self.model = get_json(f"{self.base}/v1/models")[1]["data"][0]["id"]
