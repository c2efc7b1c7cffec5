"""Issue 52: the Responses API with the conversation owned by the router,
through the official openai package: five turns chained by
previous_response_id (streamed and not), retrieve, input_items, delete,
store=false; five turns of a conversation (the Conversations API: create,
items, update, delete). On the simulator (which, like llama-server, refuses
previous_response_id) and on a real llama-server."""
import openai
import pytest

from conftest import Engine

# Sent with every turn (the API does not carry instructions over): a
# prefix long enough to fill the engines' cache blocks.
SYSTEM = "You are a terse assistant. " * 30


def ask(client, turn, **kw):
    """One turn, streamed when `turn` is odd: the response."""
    if turn % 2 == 0:
        return client.responses.create(**kw)
    final = None
    for ev in client.responses.create(stream=True, **kw):
        if ev.type == "response.completed":
            final = ev.response
    assert final is not None, f"turn {turn}: no response.completed"
    return final


def turns(client, model, n, **extra):
    """n chained turns, odd ones streamed: the responses in order."""
    prev, got = None, []
    for turn in range(n):
        kw = dict(model=model, instructions=SYSTEM, input=f"Turn {turn}: say something about rivers.",
                  max_output_tokens=8, **extra)
        if prev:
            kw["previous_response_id"] = prev
        r = ask(client, turn, **kw)
        assert r.id.startswith("resp_"), r.id
        assert r.previous_response_id == prev, (turn, r.previous_response_id, prev)
        assert r.output_text, f"turn {turn}: no text"
        got.append(r)
        prev = r.id
    return got


def test_five_turns_on_the_simulator(fleet):
    sim = fleet.sim("m", "--output-tokens", "8", "--prefix-cache-tokens", "100000")
    fleet.router()
    fleet.agent(sim, "a.key")
    fleet.wait_agents("m", 1)
    c = openai.OpenAI(base_url=fleet.base + "/v1", api_key="unused", max_retries=0)
    # The engine keeps no state: named directly, previous_response_id is
    # refused, as llama-server refuses it.
    direct = openai.OpenAI(base_url=f"http://127.0.0.1:{sim.port}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        direct.responses.create(model="m", input="x", previous_response_id="resp_1")
    rs = turns(c, "m", 5)
    assert len({r.id for r in rs}) == 5 and not any(r.id.startswith("resp_sim") for r in rs)
    # Each later turn read the earlier ones from the engine's cache: the
    # router sent the whole conversation, and it grows.
    for a, b in zip(rs, rs[1:]):
        assert b.usage.input_tokens > a.usage.input_tokens
        assert b.usage.input_tokens_details.cached_tokens > 0
    last = c.responses.retrieve(rs[-1].id)
    assert last.id == rs[-1].id and last.output_text == rs[-1].output_text
    items = c.responses.input_items.list(rs[-1].id)
    assert "Turn 4" in items.data[0].content[0].text
    # Deleted: gone, and a chain through it cannot be continued.
    c.responses.delete(rs[2].id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(rs[2].id)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="m", input="more", previous_response_id=rs[4].id, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="m", input="more", previous_response_id="resp_unknown", max_output_tokens=4)
    # store=false keeps nothing.
    r = c.responses.create(model="m", input="forget me", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    text = fleet.metrics_text()
    assert 'hivenet_responses_requests_total{model="m",kind="continued"}' in text, text


def test_five_turns_on_llama_server(fleet):
    engine = Engine(fleet)
    fleet.router()
    fleet.agent(engine, "a.key", "--engine", "llamacpp", "--warmup", "off")
    fleet.wait_agents(engine.model, 1)
    direct = openai.OpenAI(base_url=engine.base + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        direct.responses.create(model=engine.model, input="x", previous_response_id="resp_1")
    c = openai.OpenAI(base_url=fleet.base + "/v1", api_key="unused", max_retries=0)
    rs = turns(c, engine.model, 5, temperature=0)
    for a, b in zip(rs, rs[1:]):
        assert b.usage.input_tokens > a.usage.input_tokens
        # One slot: the previous turn's prompt is still in it.
        assert b.usage.input_tokens_details.cached_tokens > 0
    assert c.responses.retrieve(rs[-1].id).output_text == rs[-1].output_text


def conversation_turns(client, model, conv, n, **extra):
    """n turns of conversation conv, odd ones streamed."""
    got = []
    for turn in range(n):
        r = ask(client, turn, model=model, instructions=SYSTEM, input=f"Turn {turn}: say something about lakes.",
                max_output_tokens=8, conversation=conv, **extra)
        assert r.id.startswith("resp_"), r.id
        assert r.output_text, f"turn {turn}: no text"
        got.append(r)
    return got


def conversation_api(c, model, n, **extra):
    """The Conversations API over n turns: created with an item and
    metadata, each turn reads the items before it (the input grows) and
    adds its own, the items read back in order, updated, one item added,
    read and deleted, the conversation deleted."""
    conv = c.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada."}],
                                  metadata={"topic": "lakes"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "lakes"}, conv
    rs = conversation_turns(c, model, conv.id, n, **extra)
    for a, b in zip(rs, rs[1:]):
        assert b.usage.input_tokens > a.usage.input_tokens, (a.usage, b.usage)
    items = c.conversations.items.list(conv.id, order="asc", limit=100)
    assert len(items.data) >= 1 + 2 * n, items
    assert "Ada" in str(items.data[0]), items.data[0]
    assert "Turn 0" in str(items.data[1]), items.data[1]
    newest = c.conversations.items.list(conv.id, limit=1)
    assert newest.has_more and newest.data[0].id == items.data[-1].id
    assert c.conversations.retrieve(conv.id).metadata == {"topic": "lakes"}
    assert c.conversations.update(conv.id, metadata={"topic": "rivers"}).metadata == {"topic": "rivers"}
    added = c.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "noted"}])
    one = c.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
    assert one.id == added.data[0].id
    c.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
    with pytest.raises(openai.NotFoundError):
        c.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model=model, input="x", conversation=conv.id, previous_response_id=rs[0].id,
                           max_output_tokens=4)
    assert c.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        c.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model=model, input="x", conversation=conv.id, max_output_tokens=4)
    return rs


def test_a_conversation_on_the_simulator(fleet):
    sim = fleet.sim("m", "--output-tokens", "8", "--prefix-cache-tokens", "100000")
    fleet.router()
    fleet.agent(sim, "a.key")
    fleet.wait_agents("m", 1)
    c = openai.OpenAI(base_url=fleet.base + "/v1", api_key="unused", max_retries=0)
    rs = conversation_api(c, "m", 5)
    for a, b in zip(rs, rs[1:]):
        assert b.usage.input_tokens_details.cached_tokens > 0
    # Each turn was rebuilt from the conversation (an expansion).
    text = fleet.metrics_text()
    assert 'hivenet_responses_requests_total{model="m",kind="continued"} 5' in text, text


def test_a_conversation_on_llama_server(fleet):
    engine = Engine(fleet)
    fleet.router()
    fleet.agent(engine, "a.key", "--engine", "llamacpp", "--warmup", "off")
    fleet.wait_agents(engine.model, 1)
    c = openai.OpenAI(base_url=fleet.base + "/v1", api_key="unused", max_retries=0)
    rs = conversation_api(c, engine.model, 5, temperature=0)
    for a, b in zip(rs, rs[1:]):
        # One slot: the previous turn's prompt is still in it.
        assert b.usage.input_tokens_details.cached_tokens > 0
