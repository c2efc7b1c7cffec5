#!/usr/bin/env python3
"""Stream continuity trials (issue 33): a stream's agent dies mid-answer;
does the client still get the whole, exact answer?

MODE=sim (default): one router (--shards 2), two hivenet-sim engines (40
tokens, 5 ms apart) behind two agents. Three faults, each TRIALS times
(default 1000 for `engine`, 100 for the process faults, which restart a
process per trial):
  engine  the simulator cuts every streamed answer of one engine at a
          random token (--abort-rate 1: the connection closed without the
          stream's end, as an engine that dies); requests alternate OpenAI
          and Anthropic;
  kill    the serving agent SIGKILLed at a random moment (the link dies
          with it), then restarted;
  freeze  the serving agent SIGSTOPped at a random moment: its link goes
          silent until the router declares it dead (--heartbeat-interval
          200ms --remove-after 1s), then SIGCONT.
Every answer is compared byte for byte with the simulator's text; the
stream must end cleanly, with one role delta (one message_start) and one
final usage counting the whole answer.

MODE=real: two llama-servers (SmolLM2-135M, one thread, temperature 0,
no prompt cache: see `body`) behind two agents (--engine llamacpp). A reference answer is read through
the router first; then TRIALS times (default 50) the llama-server serving
the stream is SIGKILLed at a random moment (uniform over the stream's
reference duration) and restarted. Reports the share of trials whose text
equals the reference, why the others differ, and the gap at the seam (the
kill to the next content event) against the second engine's time to first
token (its own `timings`: prompt_ms + one predicted token).

Usage: [MODE=sim|real] [TRIALS=N] [FAULTS="engine kill freeze"] OUT=perf/<dir> \
       scripts/bench/continuity.py   (release binaries in target/release)
"""
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lib import Fleet, free_port, metric, wait_until  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("HN_BIN", os.path.join(ROOT, "target", "release"))
MODE = os.environ.get("MODE", "sim")
OUT = os.environ.get("OUT", "")
SEED = int(os.environ.get("SEED", "33"))
WORDS = ["The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".", " Hivenet",
         " routes", " every", " token", " home", "."]
SIM_TOKENS = 40
# LLAMA_EXTRA="-ub 1": llama-server evaluates prompts one token at a time,
# as it generates, so a prefilled answer's state is bit for bit the one it
# had while generating (separates the engine's numerics from the seam).
# LLAMA_BATCH_INVARIANT=1 LLAMA_EXTRA="-fa off": the build without
# llamafile's tinyBLAS (scripts/install-llama.sh) and no flash attention:
# batched prompt evaluation with one-token decoding's arithmetic, at the
# default batch size.
LLAMA_EXTRA = os.environ.get("LLAMA_EXTRA", "").split()
BATCH_INVARIANT = os.environ.get("LLAMA_BATCH_INVARIANT", "0") == "1"
ENV = dict(os.environ, HIVENET_ROUTER_ADMIN_API_KEYS="bench-admin", HIVENET_ROUTER_AUDIT_LOG_PATH="off")


def sim_text(n):
    return "".join(WORDS[i % len(WORDS)] for i in range(n))


def stream(http, path, body, on_event=None, timeout=120):
    """POST and read the SSE answer. Returns (events [(t, data dict)], clean
    end, raw text). `on_event(t, n, text)` is called at each content event."""
    c = http_conn(http, timeout)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        return [], False, r.read().decode(errors="replace")
    events, raw, buf, clean = [], [], b"", False
    try:
        while True:
            piece = r.read1(65536)
            if not piece:
                clean = True  # http.client ends on the last chunk only
                break
            raw.append(piece)
            buf += piece
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                for line in ev.split(b"\n"):
                    if line.startswith(b"data: ") and line[6:] != b"[DONE]":
                        try:
                            d = json.loads(line[6:])
                        except ValueError:
                            continue
                        t = time.monotonic()
                        events.append((t, d))
                        if on_event and content_of(d):
                            on_event(t, len(events), content_of(d))
    except (http.client.IncompleteRead, ConnectionError, OSError):
        clean = False
    c.close()
    return events, clean, b"".join(raw).decode(errors="replace")


def http_conn(port, timeout):
    return http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)


def content_of(d):
    if "choices" in d:
        ch = d.get("choices") or [{}]
        return (ch[0].get("delta") or {}).get("content") or ""
    if d.get("type") == "content_block_delta":
        return (d.get("delta") or {}).get("text") or ""
    return ""


def check(events, clean, raw, want, anthropic):
    """Why an answer is not whole ('' when it is)."""
    text = "".join(content_of(d) for _, d in events)
    if "event: error" in raw:
        return "cut"
    if not clean:
        return "no clean end"
    if text != want:
        return "text differs"
    if anthropic:
        starts = sum(1 for _, d in events if d.get("type") == "message_start")
        out = [d["usage"].get("output_tokens") for _, d in events if d.get("type") == "message_delta"]
        if starts != 1:
            return f"{starts} message_start"
        if out != [SIM_TOKENS]:
            return f"usage {out}"
    else:
        roles = sum(1 for _, d in events if "role" in ((d.get("choices") or [{}])[0].get("delta") or {}))
        ids = {d.get("id") for _, d in events}
        usage = [d["usage"] for _, d in events if d.get("usage")]
        if roles != 1:
            return f"{roles} role deltas"
        if len(ids) != 1:
            return f"{len(ids)} ids"
        if len(usage) != 1 or usage[0].get("completion_tokens") != SIM_TOKENS:
            return f"usage {usage}"
    return ""


def body_for(i, anthropic, max_tokens=100):
    b = {"model": "m", "stream": True, "max_tokens": max_tokens,
         "messages": [{"role": "user", "content": f"trial {i}"}]}
    if not anthropic:
        b["stream_options"] = {"include_usage": True}
    return b


def migrations(metrics_port):
    out = {}
    text = subprocess.run(["curl", "-s", f"http://127.0.0.1:{metrics_port}/metrics"], capture_output=True,
                          text=True).stdout
    for ln in text.splitlines():
        if ln.startswith("hivenet_stream_migrations_total{"):
            label = ln.split('outcome="', 1)[1].split('"', 1)[0]
            out[label] = out.get(label, 0) + int(float(ln.rsplit(" ", 1)[1]))
    return out


def active_of(metrics_port, peer):
    v = metric(metrics_port, f'hivenet_agent_active_requests{{peer_id="{peer}"')
    return v or 0


def engine_ok(port):
    try:
        c = http_conn(port, 2)
        c.request("GET", "/health")
        return c.getresponse().status == 200
    except OSError:
        return False


def peer_of(work, identity):
    # The agent logs its peer ID at start.
    log = os.path.join(work, identity + ".log")
    for _ in range(100):
        try:
            m = re.search(r"peer_id=(12D3\w+)", open(log).read())
            if m:
                return m.group(1)
        except OSError:
            pass
        time.sleep(0.05)
    return ""


def healthy_count(http):
    """Healthy agents of model `m` per /v1/models."""
    try:
        c = http_conn(http, 5)
        c.request("GET", "/v1/models")
        d = json.loads(c.getresponse().read())
        for m in d.get("data", []):
            if m.get("id") == "m":
                return int((m.get("agents") or {}).get("healthy", 0))
    except (OSError, ValueError):
        pass
    return 0


def run_sim(faults, trials):
    rng = random.Random(SEED)
    report = {}
    for fault in faults:
        work = tempfile.mkdtemp(prefix=f"continuity-{fault}-")
        http, mport, p2p = free_port(), free_port(), free_port()
        extra = ["--shards", "2"]
        if fault == "freeze":
            extra += ["--heartbeat-interval", "200ms", "--remove-after", "1s"]
        with Fleet(BIN, work, ENV) as f:
            f.router(http, mport, p2p, extra)
            wait_until(lambda: port_open(http), "router", 20)
            sim_args = ["--output-tokens", str(SIM_TOKENS), "--itl", "5ms", "--ttft", "5ms", "--threads", "1"]
            s1, s2 = free_port(), free_port()
            f.sim(s1, "m", sim_args + (["--abort-rate", "1"] if fault == "engine" else []))
            f.sim(s2, "m", sim_args)
            wait_until(lambda: port_open(s1) and port_open(s2), "sims", 20)
            agents = {"a1": f.agent(p2p, s1, "a1.key"), "a2": f.agent(p2p, s2, "a2.key")}
            peers = {k: peer_of(work, k + ".key") for k in agents}
            wait_until(lambda: healthy_count(http) >= 2, "2 agents", 30)
            n = trials.get(fault, 1000 if fault == "engine" else 100)
            bad, continued_before = {}, migrations(mport).get("continued", 0)
            faulted = 0
            for i in range(n):
                anthropic = fault == "engine" and i % 2 == 1
                path = "/v1/messages" if anthropic else "/v1/chat/completions"
                body = body_for(i, anthropic)
                if fault == "engine":
                    # Two streams at once: least-loaded puts one on each
                    # engine (one after the other, the router would keep
                    # away from the engine whose last answer broke).
                    import threading
                    other = {}
                    t = threading.Thread(target=lambda: other.update(r=stream(http, path, body_for(-i - 1, anthropic))))
                    t.start()
                    events, clean, raw = stream(http, path, body)
                    t.join()
                    why = check(*other["r"], sim_text(SIM_TOKENS), anthropic)
                    if why:
                        bad[why] = bad.get(why, 0) + 1
                else:
                    # Fault the serving agent after a random number of events.
                    at = rng.randint(2, SIM_TOKENS - 2)
                    done = {}

                    def on_event(t, k, _text, at=at, done=done):
                        if k == at and not done:
                            for name, peer in peers.items():
                                if active_of(mport, peer) >= 1:
                                    p = agents[name]
                                    if fault == "kill":
                                        p.kill()
                                        p.wait()
                                    else:
                                        os.kill(p.pid, signal.SIGSTOP)
                                    done[name] = p
                                    break
                    events, clean, raw = stream(http, path, body, on_event)
                    for name, p in done.items():
                        faulted += 1
                        if fault == "kill":
                            agents[name] = f.agent(p2p, s1 if name == "a1" else s2, name + ".key")
                        else:
                            os.kill(p.pid, signal.SIGCONT)
                    if done:
                        wait_until(lambda: healthy_count(http) >= 2, "agents back", 30)
                why = check(events, clean, raw, sim_text(SIM_TOKENS), anthropic)
                if why:
                    bad[why] = bad.get(why, 0) + 1
            m = migrations(mport)
            streams = 2 * n if fault == "engine" else n
            if fault == "engine":
                faulted = int(metric(mport, 'hivenet_agent_connection_resets_total{model="m",reason="stream_cut"}') or 0)
            report[fault] = {"streams": streams, "whole": streams - sum(bad.values()), "not_whole": bad,
                             "faulted": faulted,
                             "continued": m.get("continued", 0) - continued_before, "migrations": m}
            print(fault, json.dumps(report[fault]), flush=True)
    return report


def port_open(port):
    import socket
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def llama_env():
    out = subprocess.check_output([os.path.join(ROOT, "scripts/install-llama.sh")], text=True)
    env = dict(line.split("=", 1) for line in out.split() if "=" in line)
    return env["LLAMA_SERVER"].strip("'\""), env["LLAMA_MODEL"].strip("'\"")


def run_real(trials):
    server, model = llama_env()
    rng = random.Random(SEED)
    work = tempfile.mkdtemp(prefix="continuity-real-")
    http, mport, p2p = free_port(), free_port(), free_port()
    ports = [free_port(), free_port()]
    engines = {}

    def start_engine(port):
        log = open(os.path.join(work, f"llama-{port}.log"), "ab")
        p = subprocess.Popen([server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", "1",
                              "-c", "2048", "-np", "1", "--metrics"] + LLAMA_EXTRA, stdout=log, stderr=log)
        engines[port] = p
        wait_until(lambda: engine_ok(port), f"llama-server {port}", 60)

    def busy(port):
        try:
            c = http_conn(port, 2)
            c.request("GET", "/metrics")
            for ln in c.getresponse().read().decode().splitlines():
                if ln.startswith("llamacpp:requests_processing"):
                    return float(ln.rsplit(" ", 1)[1]) >= 1
        except (OSError, ValueError):
            pass
        return False

    for p in ports:
        start_engine(p)
    # cache_prompt false: llama.cpp's output at temperature 0 depends on
    # whether the prompt came from its cache (batched and incremental
    # evaluation round differently), so the reference and every trial
    # evaluate their whole prompt afresh, as the continuation does.
    body = {"model": "m", "stream": True, "temperature": 0, "max_tokens": 160, "cache_prompt": False,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]}
    rows = []
    with Fleet(BIN, work, ENV) as f:
        f.router(http, mport, p2p, ["--shards", "1"])
        wait_until(lambda: port_open(http), "router", 20)
        for i, p in enumerate(ports):
            f.agent(p2p, p, f"a{i}.key", ["--engine", "llamacpp", "--model", "m"])
        wait_until(lambda: healthy_count(http) >= 2, "2 agents", 60)
        # The reference, uninterrupted, from each engine (they must agree).
        refs = []
        for _ in range(2):
            ev, clean, raw = stream(http, "/v1/chat/completions", body)
            refs.append(("".join(content_of(d) for _, d in ev), ev[-1][0] - ev[0][0] if ev else 0))
        ref, ref_dur = refs[0]
        assert ref and refs[1][0] == ref, f"the engines disagree at temperature 0: {refs}"
        for i in range(trials):
            delay = rng.uniform(0.05, max(0.1, ref_dur * 0.95))
            state = {"first": None, "killed": None, "port": None, "after": None, "chars": 0}

            def on_event(t, k, piece, state=state, delay=delay):
                if state["killed"] is None:
                    state["text"] = state.get("text", "") + piece
                if state["first"] is None:
                    state["first"] = t
                if state["killed"] is None and t - state["first"] >= delay:
                    for port in ports:
                        if busy(port):
                            engines[port].kill()
                            state["killed"], state["port"] = time.monotonic(), port
                            state["chars"] = len(state.get("text", ""))
                            break
                elif state["killed"] is not None and state["after"] is None:
                    state["after"] = t

            ev, clean, raw = stream(http, "/v1/chat/completions", body, on_event)
            text = "".join(content_of(d) for _, d in ev)
            timings = [d.get("timings") for _, d in ev if d.get("timings")]
            row = {"trial": i, "delay_s": round(delay, 3), "killed": state["port"] is not None,
                   "whole": clean and text == ref and "event: error" not in raw, "clean": clean,
                   "same_text": text == ref}
            if state["killed"]:
                row["delivered_chars"] = state["chars"]
            if state["killed"] and state["after"]:
                row["seam_ms"] = round((state["after"] - state["killed"]) * 1e3, 1)
            if timings:
                t = timings[-1]
                row["engine_ttft_ms"] = round(t.get("prompt_ms", 0) + t.get("predicted_per_token_ms", 0), 1)
            if not row["same_text"]:
                k = next((j for j in range(min(len(text), len(ref))) if text[j] != ref[j]), min(len(text), len(ref)))
                row["diverges_at"] = k
                row["seam_text"] = [ref[max(0, k - 20):k + 20], text[max(0, k - 20):k + 20]]
            rows.append(row)
            print(json.dumps(row), flush=True)
            if state["port"] is not None:
                engines[state["port"]].wait()
                start_engine(state["port"])
                wait_until(lambda: healthy_count(http) >= 2, "agents back", 60)
        mig = migrations(mport)
    for p in engines.values():
        p.kill()
    killed = [r for r in rows if r["killed"]]
    whole = [r for r in killed if r["whole"]]
    seams = [r for r in killed if "seam_ms" in r and "engine_ttft_ms" in r]
    within = [r for r in seams if r["seam_ms"] <= r["engine_ttft_ms"] + 50]
    return {"trials": trials, "killed": len(killed), "whole": len(whole),
            "whole_share": round(len(whole) / max(1, len(killed)), 3),
            "seam_within_ttft_plus_50ms": f"{len(within)}/{len(seams)}",
            "seam_ms_median": median([r["seam_ms"] for r in seams]),
            "seam_minus_engine_ttft_ms_median": median([r["seam_ms"] - r["engine_ttft_ms"] for r in seams]),
            "seam_minus_engine_ttft_ms_max": max([r["seam_ms"] - r["engine_ttft_ms"] for r in seams], default=None),
            "migrations": mig, "engine": server, "engine_args": LLAMA_EXTRA, "reference_chars": len(ref), "reference_s": round(ref_dur, 2), "rows": rows}


def median(v):
    v = sorted(v)
    return round(v[len(v) // 2], 1) if v else None


def main():
    if MODE == "real":
        rep = run_real(int(os.environ.get("TRIALS", "50")))
    else:
        faults = os.environ.get("FAULTS", "engine kill freeze").split()
        trials = {k: int(os.environ["TRIALS"]) for k in faults} if "TRIALS" in os.environ else {}
        rep = run_sim(faults, trials)
    summary = {k: v for k, v in rep.items() if k != "rows"}
    print(json.dumps(summary, indent=1))
    if OUT:
        os.makedirs(OUT, exist_ok=True)
        tag = MODE + ("-batch-invariant" if BATCH_INVARIANT and MODE == "real" else "")
        tag += "-" + "".join(LLAMA_EXTRA).replace("-", "") if LLAMA_EXTRA else ""
        with open(os.path.join(OUT, f"{tag}.json"), "w") as fh:
            json.dump(rep, fh, indent=1)


if __name__ == "__main__":
    main()
