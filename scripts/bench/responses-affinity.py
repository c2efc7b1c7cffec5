"""The Responses API on the real engine (issue 52): three llama-servers
(SmolLM2-135M, one thread, one slot each) behind the router, a multi-turn
agent run whose conversation the router owns (`previous_response_id`), with
`least-loaded` and with `prefix-aware`; and, as the reference, the same
conversations through chat completions with the history kept by the client
(`chat-prefix-aware`). Workload: USERS conversations with their own long
instructions, TURNS turns each (16 output tokens, temperature 0), turns
interleaved across users, one client (USERS not a multiple of three, so
that least-loaded's rotation does not happen to keep each user on one
engine). Fresh engines, router and agents for
every configuration.

Per configuration: the cached share of input tokens (the engines' own
counts), mean latency per turn, and the router's CPU per request
(utime+stime of its process over the run, from /proc): what a Responses
turn costs the router against the same turn as chat.

Usage: python3 scripts/bench/responses-affinity.py BIN_DIR OUT [USERS TURNS]
(BIN_DIR: release binaries; the engine from scripts/install-llama.sh.)
"""
import json, os, shutil, statistics, subprocess, sys, tempfile, time, urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lib import free_port  # noqa: E402

BIN, OUT = sys.argv[1], sys.argv[2]
USERS = int(sys.argv[3]) if len(sys.argv) > 3 else 4
TURNS = int(sys.argv[4]) if len(sys.argv) > 4 else 5
CONFIGS = ["least-loaded", "prefix-aware", "chat-prefix-aware"]
env = dict(line.split("=", 1) for line in subprocess.check_output(["scripts/install-llama.sh"], text=True).split()
           if "=" in line)
SERVER, MODEL = env["LLAMA_SERVER"].strip("'\""), env["LLAMA_MODEL"].strip("'\"")
os.makedirs(OUT, exist_ok=True)
WORDS = ("river stone lantern orchard copper meadow harbor signal engine quiet ledger cobalt "
         "thunder velvet marble summit glacier compass ember willow").split()


def instructions(user):
    import random
    r = random.Random(user)
    rules = [f"Rule {i}: when asked about {r.choice(WORDS)} mention {r.choice(WORDS)} and {r.choice(WORDS)}."
             for i in range(60)]
    return f"You are assistant {user} of the {WORDS[user % len(WORDS)]} company. " + " ".join(rules)


def post(port, path, body, timeout=600):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
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


def cpu_seconds(pid):
    """On-CPU time of every thread of `pid` (schedstat: nanoseconds, not
    the 10 ms ticks of /proc/PID/stat)."""
    total = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(open(f"/proc/{pid}/task/{t}/schedstat").read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


def run_config(name):
    work = tempfile.mkdtemp(prefix=f"resp-aff-{name}-")
    procs = []
    try:
        ports = [free_port() for _ in range(3)]
        for p in ports:
            procs.append(subprocess.Popen([SERVER, "-m", MODEL, "--alias", "smollm", "--host", "127.0.0.1",
                                           "--port", str(p), "-t", "1", "-c", "8192", "-np", "1", "--metrics"],
                                          stdout=open(f"{work}/llama-{p}.log", "w"), stderr=subprocess.STDOUT))
        for p in ports:
            wait_http(f"http://127.0.0.1:{p}/health")
        http, met, p2p = free_port(), free_port(), free_port()
        pol = f"{work}/policy.yaml"
        strategy = "least-loaded" if name == "least-loaded" else "prefix-aware"
        open(pol, "w").write(f"routing_policy:\n  strategy: {strategy}\n")
        router = subprocess.Popen([f"{BIN}/hivenet-router", "--http-port", f"127.0.0.1:{http}",
                                   "--metrics-port", f"127.0.0.1:{met}", "--p2p-port", str(p2p),
                                   "--policy-file", pol, "--disk-db-path", f"{work}/db"],
                                  env=dict(os.environ, HIVENET_ROUTER_ADMIN_API_KEYS="bench-admin"), cwd=work,
                                  stdout=open(f"{work}/router.log", "w"), stderr=subprocess.STDOUT)
        procs.append(router)
        wait_http(f"http://127.0.0.1:{http}/health")
        for k, p in enumerate(ports):
            procs.append(subprocess.Popen([f"{BIN}/hivenet-agent", "--router-p2p", f"/ip4/127.0.0.1/tcp/{p2p}",
                                           "--backend-url", f"http://127.0.0.1:{p}", "--engine", "llamacpp",
                                           "--identity-path", f"{work}/a{k}.key", "--machine", f"llama-{k}",
                                           "--warmup", "off"],
                                          cwd=work, stdout=open(f"{work}/agent-{k}.log", "w"),
                                          stderr=subprocess.STDOUT))
        wait_http(f"http://127.0.0.1:{http}/v1/models", 60, '"healthy":3')
        results = []
        previous = {u: None for u in range(USERS)}
        history = {u: [{"role": "system", "content": instructions(u)}] for u in range(USERS)}
        cpu0 = cpu_seconds(router.pid)
        t0 = time.time()
        for turn in range(TURNS):
            for u in range(USERS):
                ask = f"Turn {turn}: which rule mentions {WORDS[(u + turn) % len(WORDS)]}?"
                if name.startswith("chat"):
                    history[u].append({"role": "user", "content": ask})
                    secs, out = post(http, "/v1/chat/completions", {"model": "smollm", "messages": history[u],
                                                                     "max_tokens": 16, "temperature": 0})
                    text = out["choices"][0]["message"]["content"] or ""
                    history[u].append({"role": "assistant", "content": text})
                    usage = out.get("usage") or {}
                    inp, cached = usage.get("prompt_tokens", 0), (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                else:
                    body = {"model": "smollm", "instructions": instructions(u), "input": ask,
                            "max_output_tokens": 16, "temperature": 0}
                    if previous[u]:
                        body["previous_response_id"] = previous[u]
                    secs, out = post(http, "/v1/responses", body)
                    previous[u] = out["id"]
                    usage = out.get("usage") or {}
                    inp, cached = usage.get("input_tokens", 0), (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
                results.append({"user": u, "turn": turn, "seconds": secs, "input": inp, "cached": cached})
        wall = time.time() - t0
        cpu = cpu_seconds(router.pid) - cpu0
        storage = {}
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{http}/admin/storage",
                                         headers={"Authorization": "Bearer bench-admin"})
            storage = json.loads(urllib.request.urlopen(req, timeout=5).read())["disk_db"]
        except Exception:
            pass
        return {"config": name, "wall": wall, "router_cpu_s": cpu, "requests": results, "storage": storage}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)


runs = [run_config(n) for n in CONFIGS]
json.dump(runs, open(f"{OUT}/raw.json", "w"), indent=1)
lines = ["| config | turns | cached share | mean s | mean vs least-loaded | router CPU per turn (ms) | stored bytes per turn |",
         "|---|---|---|---|---|---|---|"]
ll = statistics.mean(x["seconds"] for x in runs[0]["requests"])
for r in runs:
    rq = r["requests"]
    share = sum(x["cached"] for x in rq) / max(1, sum(x["input"] for x in rq))
    mean = statistics.mean(x["seconds"] for x in rq)
    st = r["storage"]
    per_turn = (st.get("responses_bytes", 0) / st["responses_count"]) if st.get("responses_count") else 0
    lines.append(f"| {r['config']} | {len(rq)} | {share:.1%} | {mean:.2f} | {mean / ll:.2f}x | "
                 f"{r['router_cpu_s'] * 1e3 / len(rq):.2f} | {per_turn:.0f} |")
table = "\n".join(lines)
open(f"{OUT}/summary.md", "w").write(
    f"# The Responses API on three llama-servers: {USERS} users x {TURNS} turns\n\n{table}\n")
print(table)
