"""Cache affinity on the real engine (issue 30): three llama-servers
(SmolLM2-135M, one thread, one slot each, their default host prompt cache)
behind the router with `least-loaded` and with `prefix-aware`, and the
single-engine oracle (one llama-server alone, asked directly: every prefix
is in its one cache). Workload: USERS conversations, each with its own long
system prompt, TURNS turns each, the engine's own answers appended to the
history (temperature 0), turns interleaved across users; CLIENTS clients
at once (each one drives its share of the users). Fresh engines, router
and agents for every configuration.

HOLDER_WAITS="3000" adds prefix-aware with `holder_wait_ms: 3000`.

The calibration check of the simulator (issue 55): ENGINE=sim runs the
same conversations on hivenet-sims instead (SIM_FLAGS: their flags; by
default the CPU shape of perf/2026-12-02-sim-calibration, one slot as the
llama-servers, 4.3 bytes a token as SmolLM2 reads these prompts); compare
its summary's cached shares with the llama-server run's. That timing was
2.6x slower than llama-server on the 2026-12-06 host: fit it to the
llama run first, as scripts/bench/affinity-side-by-side.sh does.
LLAMA_CACHE_RAM=N passes `--cache-ram N` (MiB of host prompt cache; 0:
only the slot's own context is kept) to bound the engines' caches.

Placements: every engine sits behind a recording proxy that keeps, in
the order they reached it, the bodies it was sent and the cached tokens
it answered (placements.json.gz, one list per engine). REPLAY=DIR (an
earlier run's OUT) with ENGINE=sim sends each recorded engine's bodies,
in that order, to a fresh sim of its own (SIM_FLAGS), with no router:
the same prompts on the same engines in the same order, so the cached
shares compare the caches alone, whatever order the answers came back
in (the end-to-end runs place by completion order, a race between
engines of different speed). Writes OUT/replay.md and OUT/replay.json.

Per configuration: the cached share of prompt tokens (from the engines'
usage, prompt_tokens_details.cached_tokens), mean and p95 latency per
request, and throughput (requests per second of wall time) against
least-loaded. Writes OUT/summary.md and OUT/raw.json.

Usage: python3 scripts/bench/affinity-real.py BIN_DIR OUT [USERS TURNS CLIENTS...]
       ENGINE=sim REPLAY=LLAMA_OUT SIM_FLAGS=... python3 scripts/bench/affinity-real.py BIN_DIR OUT
(BIN_DIR: release binaries; the engine from scripts/install-llama.sh.)
"""
import gzip, http.server, json, os, shutil, statistics, subprocess, sys, tempfile, threading, time, urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lib import free_port  # noqa: E402

BIN, OUT = sys.argv[1], sys.argv[2]
USERS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
TURNS = int(sys.argv[4]) if len(sys.argv) > 4 else 4
CLIENTS = [int(c) for c in sys.argv[5:]] or [1, 3]
# The agents' --capacity: llama-server with one slot queues what it cannot
# run yet, so an agent may take more than one request (CAPACITY=1: the
# router never sends a busy engine a second one).
CAPACITY = os.environ.get("CAPACITY", "4")
# Extra prefix-aware configurations with `holder_wait_ms` (wait for a full
# cache holder): HOLDER_WAITS="3000" adds prefix-aware-w3000.
HOLDER_WAITS = os.environ.get("HOLDER_WAITS", "").split()
CONFIGS = ["least-loaded", "prefix-aware"] + [f"prefix-aware-w{w}" for w in HOLDER_WAITS] + ["oracle"]
env = dict(line.split("=", 1) for line in subprocess.check_output(["scripts/install-llama.sh"], text=True).split()
           if "=" in line)
SERVER, MODEL = env["LLAMA_SERVER"].strip("'\""), env["LLAMA_MODEL"].strip("'\"")
os.makedirs(OUT, exist_ok=True)

WORDS = ("river stone lantern orchard copper meadow harbor signal engine quiet ledger cobalt "
         "thunder velvet marble summit glacier compass ember willow").split()


def system_prompt(user):
    # ~700 words of text unique to the user (its own application).
    import random
    r = random.Random(user)
    rules = [f"Rule {i}: when asked about {r.choice(WORDS)} mention {r.choice(WORDS)} and {r.choice(WORDS)}."
             for i in range(60)]
    return f"You are assistant {user} of the {WORDS[user % len(WORDS)]} company. " + " ".join(rules)


def post(port, body, timeout=600):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.time()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = json.loads(r.read())
    return time.time() - t0, out


def wait_http(url, seconds=120, needle=None):
    end = time.time() + seconds
    while time.time() < end:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200 and (needle is None or needle in r.read().decode()):
                    return
        except Exception:
            pass
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {url}")


ENGINE = os.environ.get("ENGINE", "llama")
SIM_FLAGS = os.environ.get("SIM_FLAGS", "--ttft 5ms --prefill-per-token 9.65ms --itl 30.8ms --output-tokens 16 "
                           "--prefix-cache-tokens 65536 --cache-block-tokens 1 --bytes-per-token 4.3 --max-running 1")
LLAMA_CACHE_RAM = os.environ.get("LLAMA_CACHE_RAM")


def engine(port, work):
    log = open(f"{work}/llama-{port}.log", "w")
    if ENGINE == "sim":
        return subprocess.Popen([f"{BIN}/hivenet-sim", "--port", str(port), "--model", "smollm"] + SIM_FLAGS.split(),
                                stdout=log, stderr=subprocess.STDOUT)
    ram = ["--cache-ram", LLAMA_CACHE_RAM] if LLAMA_CACHE_RAM is not None else []
    p = subprocess.Popen([SERVER, "-m", MODEL, "--alias", "smollm", "--host", "127.0.0.1", "--port", str(port),
                          "-t", "1", "-c", "8192", "-np", "1", "--metrics"] + ram, stdout=log, stderr=subprocess.STDOUT)
    return p


def cached_of(usage):
    """Prompt tokens an answer's usage says came from the engine's cache."""
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def usage_of(out):
    """The usage of a chat completion's answer, JSON or an SSE stream."""
    try:
        return json.loads(out).get("usage") or {}
    except ValueError:
        pass
    usage = {}
    for line in out.decode(errors="replace").splitlines():
        if line.startswith("data: {"):
            try:
                usage = json.loads(line[6:]).get("usage") or usage
            except ValueError:
                pass
    return usage


class Recorder:
    """A proxy in front of one engine: forwards every request as is and
    keeps, for each chat completion, its body and the engine's cached and
    prompt tokens, in the order the requests reached the engine."""

    def __init__(self, engine_port):
        self.port, self.log, self.lock = free_port(), [], threading.Lock()
        rec = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def forward(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                entry = None
                if self.command == "POST" and self.path.endswith("/chat/completions"):
                    with rec.lock:
                        entry = {"body": json.loads(body)}
                        rec.log.append(entry)
                req = urllib.request.Request(f"http://127.0.0.1:{engine_port}{self.path}", body, method=self.command,
                                             headers={k: v for k, v in self.headers.items()
                                                      if k.lower() not in ("host", "content-length", "connection")})
                try:
                    with urllib.request.urlopen(req, timeout=600) as r:
                        status, headers, out = r.status, r.headers, r.read()
                except urllib.error.HTTPError as e:
                    status, headers, out = e.code, e.headers, e.read()
                if entry is not None:
                    usage = usage_of(out)
                    entry["prompt"] = usage.get("prompt_tokens", 0)
                    entry["cached"] = cached_of(usage)
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def run_config(name, clients):
    work = tempfile.mkdtemp(prefix=f"aff-real-{name}-")
    procs = []
    try:
        n_engines = 1 if name == "oracle" else 3
        ports = [free_port() for _ in range(n_engines)]
        procs += [engine(p, work) for p in ports]
        for p in ports:
            wait_http(f"http://127.0.0.1:{p}/health")
        recorders = [Recorder(p) for p in ports]
        ports = [r.port for r in recorders]
        if name == "oracle":
            target = ports[0]
        else:
            http, met, p2p = free_port(), free_port(), free_port()
            pol = f"{work}/policy.yaml"
            if name.startswith("prefix-aware-w"):
                open(pol, "w").write("routing_policy:\n  strategy: prefix-aware\n  affinity:\n"
                                     f"    holder_wait_ms: {name[len('prefix-aware-w'):]}\n")
            else:
                open(pol, "w").write(f"routing_policy:\n  strategy: {name}\n")
            e = dict(os.environ, HIVENET_ROUTER_ADMIN_API_KEYS="bench-admin")
            procs.append(subprocess.Popen([f"{BIN}/hivenet-router", "--http-port", f"127.0.0.1:{http}",
                                           "--metrics-port", f"127.0.0.1:{met}", "--p2p-port", str(p2p),
                                           "--policy-file", pol, "--disk-db-path", f"{work}/db"],
                                          env=e, cwd=work, stdout=open(f"{work}/router.log", "w"),
                                          stderr=subprocess.STDOUT))
            wait_http(f"http://127.0.0.1:{http}/health")
            for k, p in enumerate(ports):
                procs.append(subprocess.Popen([f"{BIN}/hivenet-agent", "--router-p2p", f"/ip4/127.0.0.1/tcp/{p2p}",
                                               "--backend-url", f"http://127.0.0.1:{p}",
                                               "--engine", "vllm" if ENGINE == "sim" else "llamacpp",
                                               "--identity-path", f"{work}/a{k}.key", "--machine", f"llama-{k}",
                                               "--capacity", CAPACITY, "--warmup", "off"],
                                              cwd=work, stdout=open(f"{work}/agent-{k}.log", "w"),
                                              stderr=subprocess.STDOUT))
            wait_http(f"http://127.0.0.1:{http}/v1/models", 60, '"healthy":3')
            target = http
        results = []
        lock = threading.Lock()
        histories = {u: [{"role": "system", "content": system_prompt(u)}] for u in range(USERS)}

        def client(c):
            mine = [u for u in range(USERS) if u % clients == c]
            for turn in range(TURNS):
                for u in mine:
                    h = histories[u]
                    h.append({"role": "user", "content": f"Turn {turn}: which rule mentions {WORDS[(u + turn) % len(WORDS)]}?"})
                    body = {"model": "smollm", "messages": h, "max_tokens": 16, "temperature": 0}
                    secs, out = post(target, body)
                    usage = out.get("usage") or {}
                    text = ((out.get("choices") or [{}])[0].get("message") or {}).get("content") or ""
                    h.append({"role": "assistant", "content": text})
                    with lock:
                        results.append({"user": u, "turn": turn, "seconds": secs,
                                        "prompt": usage.get("prompt_tokens", 0),
                                        "cached": cached_of(usage)})

        ts = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
        t0 = time.time()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        wall = time.time() - t0
        affinity = ""
        if name != "oracle":
            with urllib.request.urlopen(f"http://127.0.0.1:{met}/metrics") as r:
                affinity = "\n".join(l for l in r.read().decode().splitlines() if l.startswith("hivenet_affinity_"))
        for r in recorders:
            r.close()
        return {"config": name, "clients": clients, "wall": wall, "requests": results, "affinity": affinity,
                "placements": [r.log for r in recorders]}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)


def summary(runs):
    lines = ["| clients | config | requests | cached share | of the oracle's | mean s | p95 s | mean vs least-loaded "
             "| wall s | throughput vs least-loaded |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for clients in CLIENTS:
        by = {r["config"]: r for r in runs if r["clients"] == clients}
        def share(r):
            p = sum(x["prompt"] for x in r["requests"])
            return sum(x["cached"] for x in r["requests"]) / p if p else 0
        oracle = share(by["oracle"]) if "oracle" in by else 0
        ll_mean = statistics.mean(x["seconds"] for x in by["least-loaded"]["requests"]) if "least-loaded" in by else 0
        ll_rate = len(by["least-loaded"]["requests"]) / by["least-loaded"]["wall"] if "least-loaded" in by else 0
        for name in CONFIGS:
            r = by.get(name)
            if not r:
                continue
            secs = sorted(x["seconds"] for x in r["requests"])
            mean = statistics.mean(secs)
            p95 = secs[min(len(secs) - 1, int(round(0.95 * (len(secs) - 1))))]
            s = share(r)
            lines.append(f"| {clients} | {name} | {len(secs)} | {s:.1%} | {(s / oracle if oracle else 0):.0%} | "
                         f"{mean:.2f} | {p95:.2f} | {(mean / ll_mean if ll_mean else 0):.2f}x | {r['wall']:.0f} | "
                         f"{(len(secs) / r['wall'] / ll_rate if ll_rate else 0):.2f}x |")
    return "\n".join(lines)


def replay(raw):
    """Each engine's bodies recorded in the run written to `raw`, in the
    order it got them, to a fresh sim of its own: (config, clients, the
    engine's share, the sim's)."""
    rows = []
    with gzip.open(f"{raw}/placements.json.gz", "rt") as f:
        recorded = json.load(f)
    for run in recorded:
        work = tempfile.mkdtemp(prefix="aff-replay-")
        eng = {"prompt": 0, "cached": 0}
        sim = {"prompt": 0, "cached": 0}
        try:
            for log in run.get("placements") or []:
                port = free_port()
                p = engine(port, work)
                try:
                    wait_http(f"http://127.0.0.1:{port}/health")
                    for e in log:
                        body = dict(e["body"], stream=False)
                        body.pop("stream_options", None)
                        _, out = post(port, body)
                        usage = out.get("usage") or {}
                        sim["prompt"] += usage.get("prompt_tokens", 0)
                        sim["cached"] += cached_of(usage)
                        eng["prompt"] += e.get("prompt", 0)
                        eng["cached"] += e.get("cached", 0)
                finally:
                    p.terminate()
                    p.wait(timeout=10)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        share = lambda d: d["cached"] / d["prompt"] if d["prompt"] else 0.0
        rows.append({"config": run["config"], "clients": run["clients"], "engine": share(eng), "sim": share(sim),
                     "requests": sum(len(l) for l in run.get("placements") or [])})
    return rows


if os.environ.get("REPLAY"):
    if ENGINE != "sim":
        raise SystemExit("REPLAY runs on sims: set ENGINE=sim")
    rows = replay(os.environ["REPLAY"])
    json.dump(rows, open(f"{OUT}/replay.json", "w"), indent=1)
    lines = [f"# The recorded placements of {os.environ['REPLAY']} replayed on hivenet-sim ({SIM_FLAGS})\n",
             "| clients | config | requests | engine's cached share | sim's, same placements | points apart |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['clients']} | {r['config']} | {r['requests']} | {r['engine']:.1%} | {r['sim']:.1%} | "
                     f"{abs(r['engine'] - r['sim']) * 100:.1f} |")
    open(f"{OUT}/replay.md", "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
    sys.exit(0)

runs = []
for clients in CLIENTS:
    for name in CONFIGS:
        r = run_config(name, clients)
        runs.append(r)
        print(f"{name} clients={clients}: {len(r['requests'])} requests in {r['wall']:.0f} s", flush=True)
# The placements (every prompt, whole) apart and compressed: raw.json stays small.
placements = [{"config": r["config"], "clients": r["clients"], "placements": r.pop("placements")} for r in runs]
with gzip.open(f"{OUT}/placements.json.gz", "wt") as f:
    json.dump(placements, f)
json.dump(runs, open(f"{OUT}/raw.json", "w"), indent=1)
table = summary(runs)
open(f"{OUT}/summary.md", "w").write(
    f"# Cache affinity on {'hivenet-sim (' + SIM_FLAGS + ')' if ENGINE == 'sim' else 'llama-server'}"
    f"{'' if LLAMA_CACHE_RAM is None or ENGINE == 'sim' else ' --cache-ram ' + LLAMA_CACHE_RAM}: "
    f"{USERS} users x {TURNS} turns, agent capacity {CAPACITY}\n\n{table}\n")
print(table)
