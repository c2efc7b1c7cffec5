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
    fleet.router("--shards", "2", "--driver", driver)
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
