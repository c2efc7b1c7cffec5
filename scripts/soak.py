#!/usr/bin/env python3
"""Soak: mixed hostile traffic against a router with agents that get killed
and restarted, for a bounded time; then checks that nothing is left over.

usage: scripts/soak.py BIN_DIR SECONDS [OUT_DIR]

Traffic (threads, random mix): non-streaming chats, streams read to the end,
streams dropped mid-way, requests abandoned while queued, slow clients
(body trickled byte by byte). Every ~5 s an agent is killed with SIGKILL and
restarted. Every ~0.7 s an agent with a fresh identity registers a fresh
model name and is killed a second later (issue 29: links and names must
not pile up). The history store lives on a 16 MiB tmpfs (root, as CI) that
is filled for a few seconds mid-run (a full disk). Checks at the end
(exit 1 on any failure):
- every response read to its end was complete or an error: a stream that
  ended cleanly (last chunk) carried [DONE] and exactly the simulator's
  text (no duplicate, no gap: one engine, "dying", cuts 30 % of its answers
  and those streams are continued elsewhere, at least one of them);
  no clean end of a cut stream;
- no slot, queue entry, buffered body or client connection left over;
- router RSS back within 32 MiB of its level after warm-up;
- every churned model name forgotten (no series left, no idle name);
- the store's writes failed while the disk was full and succeeded again
  without a restart.
"""
import json, os, random, signal, socket, subprocess, sys, tempfile, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib import free_port, http_get as get, wait_until as wait  # noqa: E402

BIN, SECONDS = sys.argv[1], float(sys.argv[2])
OUT = sys.argv[3] if len(sys.argv) > 3 else None
WORK = tempfile.mkdtemp(prefix="hivenet-soak-")
ENV = dict(os.environ, HIVENET_ROUTER_ADMIN_API_KEYS="soak-key", RUST_LOG="info")

HTTP, METRICS, P2P = free_port(), free_port(), free_port()
STORE_FS = os.path.join(WORK, "store-fs")
os.makedirs(STORE_FS)
if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16M", "tmpfs", STORE_FS]).returncode != 0:
    sys.exit("soak: mount -t tmpfs failed: the disk-full episode needs root (CI runs as root)")
procs = []
def spawn(args, name):
    log = open(os.path.join(WORK, name + ".log"), "ab")
    p = subprocess.Popen(args, env=ENV, stdout=log, stderr=log, cwd=WORK)
    procs.append(p); return p

router = spawn([f"{BIN}/hivenet-router", "--http-port", f"127.0.0.1:{HTTP}", "--metrics-port", f"127.0.0.1:{METRICS}",
                "--p2p-port", str(P2P), "--shards", "2", "--queue-depth", "20", "--request-timeout", "20s",
                "--body-timeout", "10s", "--heartbeat-interval", "500ms", "--stream-idle-timeout", "5s",
                "--remove-after", "2s", "--universal-flush-interval", "500ms",
                "--disk-db-path", os.path.join(STORE_FS, "db")], "router")

wait(lambda: get(HTTP, "/health")[0] == 200, "router")
sims = {}
# "dying": an engine that cuts 30 % of its answers mid-way (issue 33: those
# streams are continued on another agent, whole and without duplicates).
for name, extra in [("fast", ["--itl", "10ms", "--output-tokens", "20"]), ("slow", ["--ttft", "20ms", "--itl", "30ms", "--output-tokens", "30"]),
                    ("dying", ["--itl", "10ms", "--output-tokens", "20", "--abort-rate", "0.3"])]:
    port = free_port()
    sims[name] = port
    spawn([f"{BIN}/hivenet-sim", "--port", str(port), "--model", "soak-model"] + extra, "sim-" + name)
    wait(lambda: get(port, "/health")[0] == 200, "sim " + name)

agents = {}
def start_agent(i):
    port = list(sims.values())[i % len(sims)]
    agents[i] = spawn([f"{BIN}/hivenet-agent", "--router-p2p", f"/ip4/127.0.0.1/tcp/{P2P}", "--backend-url",
                       f"http://127.0.0.1:{port}", "--identity-path", os.path.join(WORK, f"a{i}.key"), "--capacity", "3"], f"agent{i}")
for i in range(len(sims)):
    start_agent(i)

def metrics():
    _, body = get(METRICS, "/metrics")
    return body.decode()

def metric_sum(text, prefix):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(prefix):
            total += float(line.rsplit(" ", 1)[1])
    return total

def healthy():
    _, body = get(HTTP, "/v1/models")
    data = json.loads(body).get("data", [])
    return sum(m["agents"]["healthy"] for m in data)

wait(lambda: healthy() == len(agents), "all agents")

def rss():
    for line in open(f"/proc/{router.pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024

BODY = json.dumps({"model": "soak-model", "messages": [{"role": "user", "content": "hi"}]})
SBODY = json.dumps({"model": "soak-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
stats = {k: 0 for k in ["ok", "error_status", "stream_complete", "stream_cut_with_error", "stream_cut",
                        "dropped_mid_stream", "abandoned_queued", "slow_client", "conn_errors", "violations"]}
violations = []
lock = threading.Lock()
def count(k, detail=None):
    with lock:
        stats[k] += 1
        if detail and len(violations) < 20:
            violations.append(detail)

def request(body, stream):
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: s\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}").encode()

def read_all(s):
    data = b""
    while True:
        try:
            d = s.recv(65536)
        except (socket.timeout, OSError):
            return data, False
        if not d:
            return data, True
        data += d

def one_full(stream):
    s = socket.create_connection(("127.0.0.1", HTTP), timeout=30)
    s.sendall(request(SBODY if stream else BODY, stream))
    data, eof = read_all(s)
    s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    if not head:
        count("conn_errors"); return
    status = int(head.split()[1])
    if status != 200:
        if b'"error"' in body:
            count("error_status")
        else:
            count("violations", f"status {status} without an error envelope: {data[:200]!r}")
        return
    if not stream:
        cl = [l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")]
        if cl and len(body) == int(cl[0].split(b":")[1]):
            count("ok")
        else:
            count("violations", f"short non-stream body: {data[:200]!r}")
        return
    clean = body.endswith(b"0\r\n\r\n")
    if clean and b"[DONE]" in body:
        # The simulators' words in order: a continued stream has no
        # duplicate and no gap at its seam.
        text = "".join(json.loads(l[6:]).get("choices", [{}])[0].get("delta", {}).get("content") or ""
                       for l in dechunked(body).split(b"\n") if l.startswith(b"data: {"))
        if is_sim_text(text):
            count("stream_complete")
        else:
            count("violations", f"stream text is not the simulator's: {text!r}")
    elif clean:
        count("violations", f"clean end of a cut stream: {body[-200:]!r}")
    elif b"event: error" in body:
        count("stream_cut_with_error")
    else:
        count("stream_cut")

WORDS = ["The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".", " Hivenet",
         " routes", " every", " token", " home", "."]


def is_sim_text(text):
    """The simulators' words in order, whole words, at least one: a
    continued stream's length depends on which engines served it (its
    last one's --output-tokens, or what the first had already sent)."""
    acc = ""
    i = 0
    while len(acc) < len(text):
        acc += WORDS[i % 16]
        i += 1
    return i >= 1 and acc == text


def dechunked(b):
    out = b""
    while b"\r\n" in b:
        size, _, rest = b.partition(b"\r\n")
        n = int(size or b"0", 16)
        if n == 0:
            break
        out += rest[:n]
        b = rest[n + 2:]
    return out


def dropped_mid_stream():
    s = socket.create_connection(("127.0.0.1", HTTP), timeout=10)
    s.sendall(request(SBODY, True))
    try:
        s.recv(256)
    except OSError:
        pass
    s.close(); count("dropped_mid_stream")

def abandoned_queued():
    s = socket.create_connection(("127.0.0.1", HTTP), timeout=10)
    s.sendall(request(SBODY, True))
    time.sleep(random.uniform(0.0, 0.05))
    s.close(); count("abandoned_queued")

def slow_client():
    s = socket.create_connection(("127.0.0.1", HTTP), timeout=30)
    raw = request(BODY, False)
    head, body = raw.split(b"\r\n\r\n", 1)
    s.sendall(head + b"\r\n\r\n")
    for b in body[:20]:
        s.sendall(bytes([b])); time.sleep(0.01)
    s.sendall(body[20:])
    data, _ = read_all(s)
    s.close()
    if data.startswith(b"HTTP/1.1 "):
        count("slow_client")
    else:
        count("conn_errors")

stop = None  # set after the warm-up
def worker():
    actions = [lambda: one_full(False)] * 4 + [lambda: one_full(True)] * 3 + [dropped_mid_stream, abandoned_queued, slow_client]
    while time.time() < stop:
        try:
            random.choice(actions)()
        except OSError:
            count("conn_errors")

churned = 0
def churn():
    global churned
    while time.time() < stop - 3:
        n = churned; churned += 1
        p = spawn([f"{BIN}/hivenet-agent", "--router-p2p", f"/ip4/127.0.0.1/tcp/{P2P}", "--backend-url",
                   f"http://127.0.0.1:{sims['fast']}", "--identity-path", os.path.join(WORK, f"churn{n}.key"),
                   "--model", f"churn-{n}"], f"churn{n}")
        time.sleep(1.0)
        p.send_signal(signal.SIGKILL); p.wait()
        time.sleep(random.uniform(0.0, 0.4))

full_episode = {}
def disk_full():
    time.sleep(SECONDS / 3)
    filler = os.path.join(STORE_FS, "filler")
    subprocess.run(["dd", "if=/dev/zero", "bs=64k", f"of={filler}"], stderr=subprocess.DEVNULL)
    time.sleep(3)
    os.remove(filler)
    full_episode["freed_at"] = time.time()

kills = 0
def chaos():
    global kills
    while time.time() < stop - 2:
        time.sleep(5)
        i = random.randrange(len(agents))
        agents[i].send_signal(signal.SIGKILL); agents[i].wait()
        kills += 1
        time.sleep(0.5)
        start_agent(i)

# Warm-up, then the RSS reference.
for _ in range(50):
    one_full(False)
time.sleep(1)
rss_start = rss()
stop = time.time() + SECONDS
threads = ([threading.Thread(target=worker) for _ in range(12)]
           + [threading.Thread(target=f) for f in (chaos, churn, disk_full)])
for t in threads: t.start()
peak = rss_start
while any(t.is_alive() for t in threads):
    time.sleep(1); peak = max(peak, rss())
for t in threads: t.join()
# Quiescence: agents back, nothing in flight.
wait(lambda: healthy() == len(agents), "agents back", 30)
def settled():
    m = metrics()
    return (metric_sum(m, "hivenet_agent_active_requests{") == 0 and metric_sum(m, "hivenet_queue_depth{") == 0
            and metric_sum(m, "hivenet_buffered_body_bytes") == 0 and metric_sum(m, "hivenet_client_connections") == 0)
try:
    wait(settled, "no slot, queue entry, body or connection left over", 30)
    leftovers = "none"
except SystemExit as e:
    leftovers = str(e)
def names_forgotten():
    m = metrics()
    return 'model="churn-' not in m and 'hivenet_directory_models{state="idle"} 0' in m
try:
    wait(names_forgotten, "every churned name forgotten", 15)
    names = "forgotten"
except SystemExit as e:
    names = str(e)
log = open(os.path.join(WORK, "router.log"), "rb").read().decode(errors="replace")
disk = dict(write_failures="store write failed" in log, recovered="writes succeed again" in log)
continued = metric_sum(metrics(), 'hivenet_stream_migrations_total{model="soak-model",outcome="continued"}')
time.sleep(2)
rss_end = rss()
result = dict(seconds=SECONDS, agent_kills=kills, streams_continued=continued, churned_names=churned, names=names, disk_full=disk, stats=stats, rss_mib=dict(after_warmup=rss_start, peak=peak, end=rss_end),
              leftovers=leftovers, violations=violations)
print(json.dumps(result, indent=1))
if OUT:
    os.makedirs(OUT, exist_ok=True)
    json.dump(result, open(os.path.join(OUT, "soak.json"), "w"), indent=1)
for p in procs:
    try: p.kill()
    except OSError: pass
subprocess.run(["umount", "-l", STORE_FS])
failed = (stats["violations"] > 0 or leftovers != "none" or rss_end > rss_start + 32 or names != "forgotten"
          or continued < 1
          or not (disk["write_failures"] and disk["recovered"]))
sys.exit(1 if failed else 0)
