"""The official openai and anthropic Python packages against the router and
one agent in front of a real llama-server (SmolLM2-135M, built by
scripts/install-llama.sh), streaming and not, at temperature 0: the text
and the usage are the engine's own, exactly as the engine answers the same
SDK call directly."""
import anthropic
import openai

import json
import urllib.request

from conftest import Engine, wait_until

SYSTEM = "You are a terse assistant. " * 30
PROMPT = "Name three colours."


def routed(fleet):
    engine = Engine(fleet)
    fleet.router()
    fleet.agent(engine, "a.key", "--engine", "llamacpp", "--warmup", "off")
    fleet.wait_agents(engine.model, 1)
    return engine


def agent_row(fleet):
    req = urllib.request.Request(f"{fleet.base}/admin/routing-table", headers={"Authorization": "Bearer test-admin-key"})
    with urllib.request.urlopen(req, timeout=2) as r:
        return json.loads(r.read())["agents"][0]


def test_openai_sdk_through_router_matches_the_engine(fleet):
    engine = routed(fleet)
    direct = openai.OpenAI(base_url=engine.base + "/v1", api_key="unused", max_retries=0)
    via = openai.OpenAI(base_url=fleet.base + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
    kw = dict(model=engine.model, messages=msgs, temperature=0, max_tokens=12)
    # Greedy output depends on whether the prompt came from the engine's
    # cache (other batch shapes, other rounding): a first call caches it,
    # so the compared calls all read the same cached prefix.
    direct.chat.completions.create(**kw)
    want = direct.chat.completions.create(**kw)
    got = via.chat.completions.create(**kw)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.choices[0].message.content
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.completion_tokens == want.usage.completion_tokens
    # The prefix was cached by the direct calls: the engine says so.
    assert got.usage.prompt_tokens_details.cached_tokens > 100
    # Streamed: the same text, delta by delta, usage in the last chunk.
    parts, usage = [], None
    for chunk in via.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == want.choices[0].message.content
    assert usage.completion_tokens == want.usage.completion_tokens
    # The router counted the two routed requests as the engine reported
    # them (prompt tokens, cached ones included).
    wait_until(lambda: agent_row(fleet)["universal"]["successful_requests_total"] == 2, "two successes")
    uni = agent_row(fleet)["universal"]
    assert uni["input_tokens_total"] == got.usage.prompt_tokens + usage.prompt_tokens
    assert uni["cached_prompt_tokens_total"] == (got.usage.prompt_tokens_details.cached_tokens
                                                  + usage.prompt_tokens_details.cached_tokens)


def test_anthropic_sdk_through_router_matches_the_engine(fleet):
    engine = routed(fleet)
    direct = anthropic.Anthropic(base_url=engine.base, api_key="unused", max_retries=0)
    via = anthropic.Anthropic(base_url=fleet.base, api_key="unused", max_retries=0)
    kw = dict(model=engine.model, system=SYSTEM, max_tokens=12, extra_body={"temperature": 0},
              messages=[{"role": "user", "content": PROMPT}])
    direct.messages.create(**kw)  # caches the prompt (see the OpenAI test)
    want = direct.messages.create(**kw)
    got = via.messages.create(**kw)
    assert got.content[0].text == want.content[0].text
    assert got.content[0].text
    assert got.usage.output_tokens == want.usage.output_tokens
    assert (got.usage.cache_read_input_tokens or 0) > 100
    with via.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == want.content[0].text
    assert final.usage.output_tokens == want.usage.output_tokens
    # Input counted with the cache reads (Anthropic reports them apart).
    wait_until(lambda: agent_row(fleet)["universal"]["successful_requests_total"] == 2, "two successes")
    uni = agent_row(fleet)["universal"]
    inputs = [got.usage, final.usage]
    assert uni["input_tokens_total"] == sum(u.input_tokens + (u.cache_read_input_tokens or 0)
                                            + (u.cache_creation_input_tokens or 0) for u in inputs)
