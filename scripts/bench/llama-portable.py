#!/usr/bin/env python3
"""The real engine's build, measured (issue 56): the portable x86-64-v3
llama-server that scripts/install-llama.sh builds against a -march=native
build (LLAMA_NATIVE=1 scripts/install-llama.sh) run with --no-repack, the
flag that avoids the AMX repack path that faults here. Both serve the
same model with the tests' arguments; requests alternate between them in
one run; the engine's own timings give prompt and generation tokens/s.

Usage: scripts/bench/llama-portable.py PORTABLE_BIN NATIVE_BIN MODEL [ROUNDS]
Prints a Markdown table (medians) and whether the native build without
--no-repack starts at all.
"""
import json, statistics, subprocess, sys, time, urllib.request


def start(binary, port, extra):
    p = subprocess.Popen([binary, "-m", MODEL, "--host", "127.0.0.1", "--port", str(port),
                          "-t", "1", "-c", "2048", "-np", "1", "--metrics"] + extra,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(240):
        if p.poll() is not None:
            return p, False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    # One request: a build that faults at its first matrix product dies here.
                    ask(port, "hi", 2)
                    return p, p.poll() is None
        except Exception:
            pass
        time.sleep(0.5)
    return p, False


def ask(port, prompt, n):
    body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": False,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)["timings"]


PORTABLE, NATIVE, MODEL = sys.argv[1], sys.argv[2], sys.argv[3]
ROUNDS = int(sys.argv[4]) if len(sys.argv) > 4 else 7
crash, ok = start(NATIVE, 18601, [])
crash.kill()
print(f"native build without --no-repack serves: {ok}")
servers = {"portable x86-64-v3": (18602, start(PORTABLE, 18602, [])),
           "native --no-repack": (18603, start(NATIVE, 18603, ["--no-repack"]))}
for name, (_, (_, up)) in servers.items():
    assert up, f"{name} did not start"
prompt = "The history of rivers and the cities built along them. " * 40
rows = {n: {"pp": [], "tg": []} for n in servers}
for _ in range(ROUNDS):
    for name, (port, _) in servers.items():
        t = ask(port, prompt, 64)
        rows[name]["pp"].append(t["prompt_per_second"])
        rows[name]["tg"].append(t["predicted_per_second"])
for _, (_, (p, _)) in servers.items():
    p.kill()
base = rows["portable x86-64-v3"]
print("| build | prompt tokens/s (median) | generation tokens/s (median) | prompt vs portable | generation vs portable |")
print("|---|---|---|---|---|")
for name, r in rows.items():
    pp, tg = statistics.median(r["pp"]), statistics.median(r["tg"])
    print(f"| {name} | {pp:.0f} | {tg:.1f} | {pp / statistics.median(base['pp']):.2f}x | {tg / statistics.median(base['tg']):.2f}x |")
