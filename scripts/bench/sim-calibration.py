"""Calibrate hivenet-sim from the real engine, then check the sim against it.

1. llama-server (SmolLM2-135M, one thread) on this machine is asked N
   distinct cold prompts of two kinds (synthetic words, English prose),
   each followed by the same prompt again (cached), and a follow-up turn
   that extends it (a conversation). Its own `timings` give prompt
   ms/token cold, decode ms/token and cache_n; usage gives prompt tokens,
   hence request bytes per token (the sim's stand-in for a tokenizer).
2. With SIM (path to hivenet-sim), the sim runs with the flags derived
   from 1 (`--bytes-per-token`, `--cache-block-tokens 1` as llama.cpp
   reuses every cached token, `--prefill-per-token`, `--itl`) and is asked
   the same requests: prompt tokens, cached tokens and whole-request times
   side by side.
Usage: python3 scripts/bench/sim-calibration.py LLAMA_SERVER MODEL [N] [SIM]"""
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lib import free_port, wait_http  # noqa: E402

server, model = sys.argv[1], sys.argv[2]
n = int(sys.argv[3]) if len(sys.argv) > 3 else 8
sim = sys.argv[4] if len(sys.argv) > 4 else None
med = statistics.median
PROSE = ("The router sends each request to the agent whose engine already holds the start of the "
         "conversation in its cache, so the prompt is not computed again. ")


def prompts(i):
    words = f"Request {i}: " + " ".join(f"word{i}x{j}" for j in range(60))
    prose = f"Note {i}. " + PROSE * 4
    return {"words": words, "prose": prose}


def body(messages):
    return json.dumps({"model": "m", "temperature": 0, "max_tokens": 16, "messages": messages}).encode()


def ask(port, b):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", b,
                                 {"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        v = json.loads(r.read())
    return time.perf_counter() - t, v


def run(port):
    """Per kind: (cold, warm, follow-up) lists of (seconds, response, body bytes)."""
    out = {}
    for i in range(n):
        for kind, p in prompts(i).items():
            first = [{"role": "user", "content": p}]
            follow = first + [{"role": "assistant", "content": "Understood."},
                              {"role": "user", "content": "And what does that save?"}]
            rows = out.setdefault(kind, ([], [], []))
            for k, msgs in enumerate((first, first, follow)):
                b = body(msgs)
                d, v = ask(port, b)
                rows[k].append((d, v, len(b)))
    return out


def cached(v):
    return (v["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def start(cmd, port, limit):
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_http(port, "/health", limit=limit)
    return p


port = free_port()
p = start([server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", "1", "-c", "2048", "-np", "1"],
          port, 120.0)
try:
    real = run(port)
finally:
    p.kill()
    p.wait()

cold_all = [v for kind in real.values() for _, v, _ in kind[0]]
pp = med(v["timings"]["prompt_per_token_ms"] for v in cold_all)
dec = med(v["timings"]["predicted_per_token_ms"] for kind in real.values() for rows in kind for _, v, _ in rows)
bpt = {k: med(b / v["usage"]["prompt_tokens"] for _, v, b in rows[0]) for k, rows in real.items()}
bpt_all = med(b / v["usage"]["prompt_tokens"] for rows in real.values() for _, v, b in rows[0])
print(f"engine: prompt {pp:.2f} ms/token cold, decode {dec:.2f} ms/token")
for k, rows in real.items():
    print(f"engine {k}: {med(v['usage']['prompt_tokens'] for _, v, _ in rows[0]):.0f} prompt tokens, "
          f"{bpt[k]:.2f} request bytes/token; cached again {med(cached(v) for _, v, _ in rows[1]):.0f}, "
          f"follow-up {med(cached(v) for _, v, _ in rows[2]):.0f} of "
          f"{med(v['usage']['prompt_tokens'] for _, v, _ in rows[2]):.0f}")
flags = ["--prefill-per-token", f"{pp:.2f}ms", "--itl", f"{dec:.1f}ms", "--output-tokens", "16",
         "--prefix-cache-tokens", "2048", "--cache-block-tokens", "1", "--bytes-per-token", f"{bpt_all:.2f}"]
print("sim flags: " + " ".join(flags))

if sim:
    sport = free_port()
    s = start([sim, "--port", str(sport), "--model", "m", "--ttft", "0ms"] + flags, sport, 20.0)
    try:
        fake = run(sport)
    finally:
        s.kill()
        s.wait()
    print("\n| kind | turn | prompt tokens: engine / sim | cached: engine / sim | whole request ms: engine / sim |")
    print("|---|---|---|---|---|")
    for k in real:
        for t, name in enumerate(("cold", "same again", "follow-up")):
            r, f = real[k][t], fake[k][t]
            print(f"| {k} | {name} | {med(v['usage']['prompt_tokens'] for _, v, _ in r):.0f} / "
                  f"{med(v['usage']['prompt_tokens'] for _, v, _ in f):.0f} | "
                  f"{med(cached(v) for _, v, _ in r):.0f} / {med(cached(v) for _, v, _ in f):.0f} | "
                  f"{med(d for d, _, _ in r) * 1e3:.0f} / {med(d for d, _, _ in f) * 1e3:.0f} |")
