#!/usr/bin/env python3
"""Whether a llama-server continues an assistant prefill exactly as it
generated it (issue 33), without router or agent: one 160-token answer
at temperature 0 (prompt cache off), then 20 prefills of its first k
tokens (k spread over the answer), each continued with max_tokens reduced
by k; prints how many of the 20 give the same text, and where the others
diverge (k, prefill chars, chars after the prefill).
usage: prefill-exact.py LLAMA_SERVER MODEL [llama-server flags...]
  (LLAMA_SERVER, MODEL: scripts/install-llama.sh, LLAMA_BATCH_INVARIANT=1
  for the batch-invariant build)
"""
import http.client
import json
import subprocess
import sys
import time

server, model, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
port = 18555
p = subprocess.Popen([server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", "1", "-c", "2048", "-np", "1"] + extra,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
def req(body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    return c.getresponse().read()
for _ in range(600):
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=2); c.request("GET", "/health")
        if c.getresponse().status == 200: break
    except OSError: pass
    time.sleep(0.1)
msgs = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]
base = {"model": "m", "temperature": 0, "max_tokens": 160, "cache_prompt": False}
# reference with per-token pieces (stream)
c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
c.request("POST", "/v1/chat/completions", json.dumps(dict(base, messages=msgs, stream=True)), {"content-type": "application/json"})
r = c.getresponse(); pieces = []
for line in r.read().decode().splitlines():
    if line.startswith("data: ") and line != "data: [DONE]":
        d = json.loads(line[6:])
        for ch in d.get("choices", []):
            t = ch.get("delta", {}).get("content")
            if t: pieces.append(t)
ref = "".join(pieces)
n = len(pieces); ok = 0; rows = []
cuts = [int(n * k / 21) for k in range(1, 21)]
for k in cuts:
    pre = "".join(pieces[:k])
    d = req(dict(base, messages=msgs + [{"role": "assistant", "content": pre}], max_tokens=160 - k))
    txt = json.loads(d)["choices"][0]["message"]["content"]
    # llama.cpp streams the prefill back before what it generates.
    full = txt if txt.startswith(pre) else pre + txt
    # Over the common length: the reduced max_tokens may end a token apart.
    m = min(len(full), len(ref))
    same = full[:m] == ref[:m]
    ok += same
    if not same:
        j = next(i for i in range(m) if full[i] != ref[i])
        rows.append((k, len(pre), j - len(pre)))
print(json.dumps({"args": extra, "pieces": n, "cuts": len(cuts), "same": ok, "diverge(k,prelen,after)": rows}))
p.kill()
