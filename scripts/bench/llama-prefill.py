#!/usr/bin/env python3
"""What an engine setting costs in prompt evaluation (issue 33): llama-server's
own prompt timing for a fresh prompt (cache off) of about PROMPT_TOKENS
tokens, and its one-token decode speed, REPS times per setting, settings
interleaved so that the machine's drift hits each alike.

A setting is NAME=BUILD:ARGS, BUILD `default` or `batch-invariant`
(scripts/install-llama.sh, LLAMA_BATCH_INVARIANT=1), ARGS llama-server
flags joined by commas. Prints a Markdown table (medians).
usage: llama-prefill.py [SETTING...]
  default: default=default: ub1=default:-ub,1 bi=batch-invariant:-fa,off
"""
import http.client
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPS = int(os.environ.get("REPS", "5"))
PROMPT_TOKENS = int(os.environ.get("PROMPT_TOKENS", "1000"))


def install(build):
    env = dict(os.environ, LLAMA_BATCH_INVARIANT="1" if build == "batch-invariant" else "0")
    out = subprocess.check_output([os.path.join(ROOT, "scripts/install-llama.sh")], text=True, env=env)
    kv = dict(line.split("=", 1) for line in out.split() if "=" in line)
    return kv["LLAMA_SERVER"], kv["LLAMA_MODEL"]


def start(server, model, args, port):
    p = subprocess.Popen([server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", "1", "-c", "4096",
                          "-np", "1"] + args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return p
        except OSError:
            pass
        time.sleep(0.1)
    p.kill()
    sys.exit(f"llama-server on {port} did not come up")


def timings(port, prompt):
    body = {"model": "m", "temperature": 0, "max_tokens": 32, "cache_prompt": False, "ignore_eos": True,
            "messages": [{"role": "user", "content": prompt}]}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    d = json.loads(r.read())
    if r.status != 200:
        sys.exit(f"llama-server answered {r.status}: {d}")
    return d["timings"]


def main():
    specs = sys.argv[1:] or ["default=default:", "ub1=default:-ub,1", "batch-invariant=batch-invariant:-fa,off"]
    words = ("the keeper climbed the stairs while the storm rolled over the rocks and the lamp "
             "turned slowly above the sea ").split()
    prompt = " ".join(words[i % len(words)] + str(i % 7) for i in range(PROMPT_TOKENS // 2))
    servers = []
    for k, spec in enumerate(specs):
        name, rest = spec.split("=", 1)
        build, joined = rest.split(":", 1)
        args = [a for a in joined.split(",") if a]
        server, model = install(build)
        port = 18600 + k
        servers.append((name, build, args, start(server, model, args, port), port))
    rows = {s[0]: [] for s in servers}
    try:
        for _ in range(REPS):
            for name, _, _, _, port in servers:
                rows[name].append(timings(port, prompt))
    finally:
        for s in servers:
            s[3].kill()
    print(f"| setting | build | flags | prompt tokens | prompt eval tokens/s | decode tokens/s | prompt eval vs {servers[0][0]} |")
    print("|---|---|---|---|---|---|---|")
    base = statistics.median(t["prompt_per_second"] for t in rows[servers[0][0]])
    for name, build, args, _, _ in servers:
        t = rows[name]
        pps = statistics.median(x["prompt_per_second"] for x in t)
        dps = statistics.median(x["predicted_per_second"] for x in t)
        print(f"| {name} | {build} | `{' '.join(args) or '(none)'}` | {t[0]['prompt_n']} | {pps:.1f} | {dps:.1f} | {pps / base:.2f}x |")


if __name__ == "__main__":
    main()
