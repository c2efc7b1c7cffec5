"""Calibrate hivenet-sim's prefix cache from the real engine: llama-server
(SmolLM2-135M, one thread) on this machine, asked N distinct cold prompts
of about 200 tokens and then the same prompts again (cached), reports its
own timings (prompt_per_token_ms cold, predicted_per_token_ms, cache_n).
Prints the medians and the sim flags they give.
Usage: python3 scripts/bench/sim-calibration.py LLAMA_SERVER MODEL [N]"""
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
port = free_port()
p = subprocess.Popen([server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", "1", "-c", "2048",
                      "-np", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    wait_http(port, "/health", limit=120.0)

    def ask(prompt):
        body = json.dumps({"model": "m", "temperature": 0, "max_tokens": 16,
                           "messages": [{"role": "user", "content": prompt}]}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
        t = time.perf_counter()
        with urllib.request.urlopen(req, timeout=120) as r:
            v = json.loads(r.read())
        return time.perf_counter() - t, v["timings"]

    cold, warm = [], []
    for i in range(n):
        prompt = f"Request {i}: " + " ".join(f"word{i}x{j}" for j in range(60))
        cold.append(ask(prompt))
        warm.append(ask(prompt))
    med = statistics.median
    pp = med(t["prompt_per_token_ms"] for _, t in cold)
    dec = med(t["predicted_per_token_ms"] for _, t in cold + warm)
    pn = med(t["prompt_n"] for _, t in cold)
    cached = med(t["cache_n"] for _, t in warm)
    print(f"cold prompts: median {pn:.0f} tokens, prompt {pp:.2f} ms/token")
    print(f"warm: median cache_n {cached:.0f} tokens, prompt {med(t['prompt_ms'] for _, t in warm):.1f} ms "
          f"(cold {med(t['prompt_ms'] for _, t in cold):.1f} ms)")
    print(f"decode: {dec:.2f} ms/token")
    print(f"whole request median: cold {med(d for d, _ in cold) * 1e3:.0f} ms, warm {med(d for d, _ in warm) * 1e3:.0f} ms")
    print(f"sim flags: --prefill-per-token {pp:.1f}ms --itl {dec:.1f}ms --prefix-cache-tokens 2048")
finally:
    p.kill()
    p.wait()
