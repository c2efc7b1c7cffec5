"""The official openai and anthropic Python packages against the router,
two agents and two hivenet-sim backends, on both I/O drivers."""
import re
import threading

import anthropic
import openai
import pytest

# The HTTP library under the SDK: httpx, or httpx2 in newer releases.
try:
    import httpx2 as http_lib
except ImportError:  # pragma: no cover - depends on the installed SDK
    import httpx as http_lib

# What hivenet-sim generates, token by token (bench/src/sim.rs WORDS).
WORDS = ["The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".",
         " Hivenet", " routes", " every", " token", " home", "."]


def generated(n):
    return "".join(WORDS[i % len(WORDS)] for i in range(n))


def success_by_agent(text):
    out = {}
    for line in text.splitlines():
        if line.startswith("hivenet_agent_requests_success_total{"):
            peer = re.search(r'peer_id="([^"]+)"', line).group(1)
            out[peer] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize("driver", ["auto", "epoll"])
def test_openai_chat_streaming_and_not_over_two_agents(fleet, driver):
    fleet.router("--shards", "2", "--driver", driver)
    s1 = fleet.sim("sdk-model", "--output-tokens", "12", "--itl", "1ms")
    s2 = fleet.sim("sdk-model", "--output-tokens", "12", "--itl", "1ms")
    fleet.agent(s1, "a1.key")
    fleet.agent(s2, "a2.key")
    fleet.wait_agents("sdk-model", 2)
    client = openai.OpenAI(base_url=fleet.base + "/v1", api_key="unused", max_retries=0)
    for _ in range(6):
        r = client.chat.completions.create(model="sdk-model", messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.content == generated(12)
        assert r.usage.completion_tokens == 12
    for _ in range(6):
        stream = client.chat.completions.create(model="sdk-model", messages=[{"role": "user", "content": "hi"}],
                                                stream=True, stream_options={"include_usage": True})
        text, usage = "", None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.usage:
                usage = chunk.usage
        assert text == generated(12)
        assert usage is not None and usage.completion_tokens == 12
    counts = success_by_agent(fleet.metrics_text())
    assert len(counts) == 2 and all(v > 0 for v in counts.values()), counts


def test_anthropic_streaming_messages(fleet):
    fleet.router("--shards", "2")
    s1 = fleet.sim("claude-sim", "--output-tokens", "9")
    fleet.agent(s1, "a1.key")
    fleet.wait_agents("claude-sim", 1)
    client = anthropic.Anthropic(base_url=fleet.base, api_key="unused", max_retries=0)
    text = ""
    with client.messages.stream(model="claude-sim", max_tokens=50, messages=[{"role": "user", "content": "hi"}]) as stream:
        for t in stream.text_stream:
            text += t
        final = stream.get_final_message()
    assert text == generated(9)
    assert final.usage.output_tokens == 9
    msg = client.messages.create(model="claude-sim", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert msg.content[0].text == generated(4)


@pytest.mark.parametrize("driver", ["auto", "epoll"])
def test_agent_killed_mid_stream_raises(fleet, driver):
    # Continuation off: the cut itself (test_*_continues: on).
    fleet.router("--shards", "2", "--driver", driver, "--stream-migrations", "0")
    slow = ("--output-tokens", "200", "--itl", "50ms")
    s1 = fleet.sim("kill-model", *slow)
    s2 = fleet.sim("kill-model", *slow)
    a1 = fleet.agent(s1, "a1.key")
    a2 = fleet.agent(s2, "a2.key")
    fleet.wait_agents("kill-model", 2)
    client = openai.OpenAI(base_url=fleet.base + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model="kill-model", messages=[{"role": "user", "content": "hi"}], stream=True)
    it = iter(stream)
    first = next(it)
    assert first.choices[0].delta.content == "The"
    # Kill the agent that serves this stream (its sim is the busy one).
    busy = [line for line in fleet.metrics_text().splitlines()
            if line.startswith("hivenet_agent_active_requests{") and line.endswith(" 1")]
    assert len(busy) == 1, busy
    log1 = open(a1.log_path).read()
    peer1 = re.search(r"peer_id=(12D3KooW\w+)", log1).group(1)
    victim = a1 if peer1 in busy[0] else a2
    victim.kill()
    # A cut stream surfaces as the router's SSE error event (the SDK raises
    # APIError with its message), or as the transport's error (httpx/httpx2
    # under the SDK: an incomplete chunked body); never as a clean end.
    with pytest.raises((http_lib.TransportError, openai.APIError)) as cut:
        for _ in it:
            pass
    if isinstance(cut.value, openai.APIError) and not isinstance(cut.value, openai.APIConnectionError):
        assert "stream cut" in str(cut.value), cut.value
    from conftest import wait_until
    wait_until(lambda: fleet.healthy("kill-model") == 1, "agent removal", limit=1)
    active = sum(float(l.rsplit(" ", 1)[1]) for l in fleet.metrics_text().splitlines()
                 if l.startswith("hivenet_agent_active_requests{"))
    assert active == 0


@pytest.mark.parametrize("driver,stop", [("auto", "kill"), ("epoll", "kill"), ("auto", "drain")])
def test_agent_stopped_mid_stream_continues(fleet, driver, stop):
    """The serving agent killed (SIGKILL) or drained (SIGTERM, its
    --drain-timeout shorter than the stream) mid-stream: the SDK sees one
    uninterrupted stream with the whole text (issue 33)."""
    fleet.router("--shards", "2", "--driver", driver)
    slow = ("--output-tokens", "60", "--itl", "30ms")
    s1 = fleet.sim("cont-model", *slow)
    s2 = fleet.sim("cont-model", *slow)
    a1 = fleet.agent(s1, "a1.key", "--drain-timeout", "300ms")
    a2 = fleet.agent(s2, "a2.key", "--drain-timeout", "300ms")
    fleet.wait_agents("cont-model", 2)
    client = openai.OpenAI(base_url=fleet.base + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model="cont-model", messages=[{"role": "user", "content": "hi"}],
                                            stream=True, stream_options={"include_usage": True})
    it = iter(stream)
    chunks = [next(it) for _ in range(5)]
    busy = [line for line in fleet.metrics_text().splitlines()
            if line.startswith("hivenet_agent_active_requests{") and line.endswith(" 1")]
    assert len(busy) == 1, busy
    peer1 = re.search(r"peer_id=(12D3KooW\w+)", open(a1.log_path).read()).group(1)
    victim = a1 if peer1 in busy[0] else a2
    if stop == "kill":
        victim.kill()
    else:
        victim.terminate()
    chunks += list(it)
    if stop == "drain":
        assert victim.wait(timeout=10) == 0
        assert "--drain-timeout passed" in open(victim.log_path).read()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == generated(60)
    assert len({c.id for c in chunks}) == 1
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1
    usage = [c.usage for c in chunks if c.usage]
    assert len(usage) == 1 and usage[0].completion_tokens == 60, usage


def test_anthropic_stream_continues_past_a_dying_engine(fleet):
    """An engine that dies in the middle of every answer, another that does
    not: the Anthropic SDK's streams are whole wherever they landed."""
    fleet.router("--shards", "2")
    bad = fleet.sim("cont-claude", "--output-tokens", "30", "--itl", "2ms", "--abort-rate", "1")
    good = fleet.sim("cont-claude", "--output-tokens", "30", "--itl", "2ms")
    fleet.agent(bad, "bad.key")
    fleet.agent(good, "good.key")
    fleet.wait_agents("cont-claude", 2)
    client = anthropic.Anthropic(base_url=fleet.base, api_key="unused", max_retries=0)
    results = []

    def one(i):
        text = ""
        with client.messages.stream(model="cont-claude", max_tokens=100,
                                    messages=[{"role": "user", "content": f"hi {i}"}]) as stream:
            for t in stream.text_stream:
                text += t
            results.append((text, stream.get_final_message().usage.output_tokens))

    # Two at once: least-loaded puts one on each engine.
    for i in range(0, 6, 2):
        ts = [threading.Thread(target=one, args=(i + k,)) for k in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert len(results) == 6
    for text, out in results:
        assert text == generated(30)
        assert out == 30
    continued = sum(float(l.rsplit(" ", 1)[1]) for l in fleet.metrics_text().splitlines()
                    if l.startswith('hivenet_stream_migrations_total{model="cont-claude",outcome="continued"}'))
    assert continued >= 1


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_agent_drained_under_load_cuts_no_stream(fleet, sdk):
    """Six streams over two agents, one agent drained (SIGTERM, its
    --drain-timeout shorter than the streams) while all six run: each SDK
    stream is one uninterrupted answer with the whole text and one usage,
    and the streams of the drained agent were continued (issue 33)."""
    fleet.router("--shards", "2")
    slow = ("--output-tokens", "50", "--itl", "30ms")
    s1 = fleet.sim("drain-model", *slow)
    s2 = fleet.sim("drain-model", *slow)
    a1 = fleet.agent(s1, "a1.key", "--drain-timeout", "300ms")
    fleet.agent(s2, "a2.key", "--drain-timeout", "300ms")
    fleet.wait_agents("drain-model", 2)
    streams = 6
    started = threading.Barrier(streams + 1, timeout=30)
    results, errors = [], []

    def openai_stream(i):
        client = openai.OpenAI(base_url=fleet.base + "/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model="drain-model", messages=[{"role": "user", "content": f"hi {i}"}],
            stream=True, stream_options={"include_usage": True})
        chunks = []
        for c in stream:
            chunks.append(c)
            if len(chunks) == 3:
                started.wait()
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        roles = sum(1 for c in chunks if c.choices and c.choices[0].delta.role)
        usage = [c.usage.completion_tokens for c in chunks if c.usage]
        return text, len({c.id for c in chunks}), roles, usage

    def anthropic_stream(i):
        client = anthropic.Anthropic(base_url=fleet.base, api_key="unused", max_retries=0)
        text, ids, n = "", set(), 0
        with client.messages.stream(model="drain-model", max_tokens=100,
                                    messages=[{"role": "user", "content": f"hi {i}"}]) as stream:
            for event in stream:
                if event.type == "message_start":
                    ids.add(event.message.id)
                if event.type == "text":
                    text += event.text
                    n += 1
                    if n == 2:
                        started.wait()
            final = stream.get_final_message()
        return text, len(ids), 1, [final.usage.output_tokens]

    def run(i):
        try:
            results.append((openai_stream if sdk == "openai" else anthropic_stream)(i))
        except Exception as e:  # reported below with the others
            errors.append(repr(e))
            started.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    started.wait()  # every stream has its first tokens: all six are running
    active = {}
    for line in fleet.metrics_text().splitlines():
        if line.startswith("hivenet_agent_active_requests{"):
            peer = re.search(r'peer_id="([^"]+)"', line).group(1)
            active[peer] = float(line.rsplit(" ", 1)[1])
    peer1 = re.search(r"peer_id=(12D3KooW\w+)", open(a1.log_path).read()).group(1)
    assert active.get(peer1, 0) >= 1, active  # the drained agent has streams in flight
    a1.terminate()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert a1.wait(timeout=10) == 0
    assert len(results) == streams
    for text, ids, roles, usage in results:
        assert text == generated(50)
        assert ids == 1 and roles == 1
        assert usage == [50], usage
    continued = sum(float(l.rsplit(" ", 1)[1]) for l in fleet.metrics_text().splitlines()
                    if l.startswith('hivenet_stream_migrations_total{model="drain-model",outcome="continued"}'))
    assert continued >= active[peer1], (continued, active)


def test_priority_header_through_both_sdks(fleet):
    """`X-Hivenet-Priority` as the SDKs send it (extra_headers): raising a
    request above its key's class (anonymous: standard) is a 400
    request_invalid each SDK raises as BadRequestError; lowering it to
    batch puts it behind a standard request queued after it (issue 32)."""
    fleet.router("--shards", "1")
    sim = fleet.sim("prio-model", "--ttft", "600ms", "--output-tokens", "3")
    fleet.agent(sim, "a1.key", "--capacity", "1")
    fleet.wait_agents("prio-model", 1)
    oa = openai.OpenAI(base_url=fleet.base + "/v1", api_key="unused", max_retries=0)
    an = anthropic.Anthropic(base_url=fleet.base, api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="prio-model", messages=msgs,
                                   extra_headers={"X-Hivenet-Priority": "interactive"})
    assert e.value.body["code"] == "request_invalid", e.value.body
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model="prio-model", max_tokens=3, messages=msgs,
                           extra_headers={"X-Hivenet-Priority": "nonsense"})
    assert "X-Hivenet-Priority" in str(e.value) or "priority" in str(e.value).lower(), e.value
    done, lock = [], threading.Lock()

    def send(label, fn):
        fn()
        with lock:
            done.append(label)

    reqs = [
        ("busy", lambda: oa.chat.completions.create(model="prio-model", messages=msgs)),
        ("lowered", lambda: an.messages.create(model="prio-model", max_tokens=3, messages=msgs,
                                              extra_headers={"X-Hivenet-Priority": "batch"})),
        ("standard", lambda: oa.chat.completions.create(model="prio-model", messages=msgs)),
    ]
    from conftest import wait_until
    threads = []
    for label, fn in reqs:
        t = threading.Thread(target=send, args=(label, fn))
        t.start()
        threads.append(t)
        # Each holds the slot or waits for it before the next is sent.
        n = len(threads)
        wait_until(lambda: active_requests(fleet) == 1 and queue_depth(fleet, "prio-model") == n - 1,
                   f"{label} running or queued")
    for t in threads:
        t.join(timeout=30)
    assert done == ["busy", "standard", "lowered"], done


def queue_depth(fleet, model):
    for line in fleet.metrics_text().splitlines():
        if line.startswith("hivenet_queue_depth{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def active_requests(fleet):
    return sum(float(l.rsplit(" ", 1)[1]) for l in fleet.metrics_text().splitlines()
               if l.startswith("hivenet_agent_active_requests{"))
