"""Registered agent links against the router's caps and memory.

Usage: python3 links-registered.py BIN_DIR LINKS MODELS [PER_ADDRESS_CAP]

Starts a router (defaults except the per-address cap, so one loopback
address can reach the total cap), opens LINKS noise links with fresh
identities registering MODELS distinct names (hivenet-link-flood), and
reports RSS and /metrics size before, with the links held, and after
they closed.
"""
import json, os, subprocess, sys, time
sys.path.insert(0, "scripts")
from lib import free_port, http_get

BIN, LINKS, MODELS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
PER_ADDR = sys.argv[4] if len(sys.argv) > 4 else "100000"
H, M, P = free_port(), free_port(), free_port()
env = dict(os.environ, HIVENET_ROUTER_ADMIN_API_KEYS="k")
work = f"/tmp/probe/links-{os.getpid()}"; os.makedirs(work, exist_ok=True)
ROUTER = os.environ.get("ROUTER_BIN", f"{BIN}/hivenet-router")
r = subprocess.Popen([ROUTER, "--http-port", f"127.0.0.1:{H}", "--metrics-port", f"127.0.0.1:{M}",
                      "--p2p-port", str(P), "--max-agent-links-per-address", PER_ADDR, "--remove-after", "2s"],
                     env=env, cwd=work, stdout=open(work + "/r.log", "w"), stderr=subprocess.STDOUT)
for _ in range(100):
    try:
        if http_get(H, "/health")[0] == 200: break
    except OSError: pass
    time.sleep(0.1)
time.sleep(1)

def rss():
    return int([l for l in open(f"/proc/{r.pid}/status") if l.startswith("VmRSS")][0].split()[1]) / 1024

def metrics():
    return http_get(M, "/metrics")[1].decode()

def refusals(m):
    out = {}
    for l in m.splitlines():
        if l.startswith("hivenet_agent_link_refusals_total{"):
            out[l.split('"')[1]] = float(l.rsplit(" ", 1)[1])
    return out

out = dict(links=LINKS, models=MODELS, per_address_cap=int(PER_ADDR),
           rss_mib_before=round(rss(), 1), metrics_bytes_before=len(metrics()))
f = subprocess.Popen([f"{BIN}/hivenet-link-flood", "--router", f"127.0.0.1:{P}", "--links", str(LINKS),
                      "--models", str(MODELS), "--hold", "8s", "--concurrency", "32"],
                     stdout=subprocess.PIPE, text=True)
dialled = json.loads(f.stdout.readline())
time.sleep(3)
m = metrics()
out.update(flood_dialled=dialled, rss_mib_held=round(rss(), 1), metrics_bytes_held=len(m),
           agents_registered_router_side=sum(1 for l in m.splitlines() if l.startswith("hivenet_routing_agent_healthy{")),
           refusals=refusals(m), health_held=http_get(H, "/health")[0])
held = json.loads(f.stdout.readline()); f.wait()
out["flood_held"] = held
time.sleep(6)  # links gone, names forgotten after --remove-after
m = metrics()
out.update(rss_mib_after=round(rss(), 1), metrics_bytes_after=len(m))
reg = held["registered"]
if reg:
    out["kib_per_registered_link"] = round((out["rss_mib_held"] - out["rss_mib_before"]) * 1024 / reg, 1)
r.terminate(); r.wait()
print(json.dumps(out))
