import socket, subprocess, time, os, sys
bin_dir = sys.argv[1]; n = int(sys.argv[2]); bodies = int(sys.argv[3])
env = dict(os.environ, HIVENET_ROUTER_ADMIN_API_KEYS="k")
os.makedirs("/tmp/memprobe", exist_ok=True)
p = subprocess.Popen([f"{bin_dir}/hivenet-router", "--http-port", "127.0.0.1:23080", "--metrics-port", "127.0.0.1:23112", "--p2p-port", "23900", "--disk-db-path", "/tmp/memprobe/db", "--reset-disk-db", "--body-timeout", "120s"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/tmp/memprobe")
time.sleep(1.0)
def rss():
    for l in open(f"/proc/{p.pid}/status"):
        if l.startswith("VmRSS"): return int(l.split()[1]) // 1024
base = rss()
socks = []
for i in range(n):
    s = socket.create_connection(("127.0.0.1", 23080)); socks.append(s)
time.sleep(1.0)
idle = rss()
held = []
declared = 10 * 1024 * 1024
chunk = b"x" * (declared - 1024)
ok = 0
for i in range(bodies):
    s = socket.create_connection(("127.0.0.1", 23080))
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {declared}\r\n\r\n".encode())
    s.settimeout(0.2)
    try:
        d = s.recv(100)
        if d: s.close(); continue
    except socket.timeout:
        pass
    s.settimeout(None)
    s.sendall(chunk); held.append(s); ok += 1
time.sleep(1.0)
full = rss()
print(f"baseline {base} MiB; +{n} idle connections: {idle} MiB ({(idle-base)*1024/max(n,1):.1f} KiB each); +{ok} stalled 10 MiB bodies admitted of {bodies}: {full} MiB")
p.kill()
