import socket, subprocess, sys, time, os, json
sys.path.insert(0, "scripts")
from lib import free_port, http_get
BIN = sys.argv[1]
H, M, P = free_port(), free_port(), free_port()
env = dict(os.environ, HIVENET_ROUTER_ADMIN_API_KEYS="k")
work = "/tmp/probe/run"; os.makedirs(work, exist_ok=True)
r = subprocess.Popen([f"{BIN}/hivenet-router", "--http-port", f"127.0.0.1:{H}", "--metrics-port", f"127.0.0.1:{M}", "--p2p-port", str(P)],
                     env=env, cwd=work, stdout=open(work + "/r.log", "w"), stderr=subprocess.STDOUT)
time.sleep(1.5)
def rss():
    return int([l for l in open(f"/proc/{r.pid}/status") if l.startswith("VmRSS")][0].split()[1]) // 1024
before = rss()
socks = []
t0 = time.time()
for i in range(10000):
    try:
        s = socket.create_connection(("127.0.0.1", P), timeout=2)
        socks.append(s)
    except OSError:
        pass
time.sleep(2)
m = http_get(M, "/metrics")[1].decode()
refused = sum(float(l.rsplit(" ", 1)[1]) for l in m.splitlines() if l.startswith("hivenet_agent_links_rejected_total"))
health = http_get(H, "/health")[0]
out = dict(attempted=10000, connected_client_side=len(socks), refused_counted=refused, rss_mib_before=before, rss_mib_after=rss(),
           health_after=health, metrics_bytes=len(m), seconds=round(time.time() - t0, 1))
for s in socks: s.close()
r.terminate(); r.wait()
print(json.dumps(out))
