"""Hold at zero through the official SDKs: a request for a model at zero
is held (keepalives every 300 ms) and served once an agent registers,
streaming and not, OpenAI and Anthropic. And what each SDK makes of a
committed 200 whose body ends in a late model_waking error (the seed warns
that a non-streaming client may take it for a success): measured here,
written in the README; if an SDK changes, this fails."""
import json
import threading
import time
import urllib.request

import anthropic
import openai
import pytest

ADMIN = "test-admin-key"


def site(fleet, budget, keepalive="300ms"):
    fleet.router("--site-id", "a", "--wake-keepalive", keepalive)
    body = {"version": "1", "sites": [{"site_id": "a", "base_url": fleet.base}],
            "placements": [{"site_id": "a", "model": "sdk-model", "kind": "chat",
                            "scale_from_zero": True, "hold_budget": budget}]}
    req = urllib.request.Request(fleet.base + "/admin/sibling-map", data=json.dumps(body).encode(), method="PUT",
                                 headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200


def wake_later(fleet, after):
    def run():
        time.sleep(after)
        sim = fleet.sim("sdk-model", "--output-tokens", "5")
        fleet.agent(sim, "agent.key")
    t = threading.Thread(target=run)
    t.start()
    return t


def held_together(fleet, calls):
    """Run every call in `calls` at once while the model is at zero, wake
    it 1.5 s later, and return (result, seconds) per call: each of them was
    held (issue 28: the Anthropic call used to start after the wake)."""
    out = [None] * len(calls)

    def run(i, f):
        t0 = time.time()
        try:
            out[i] = (f(), time.time() - t0)
        except Exception as e:  # reported below, with its call
            out[i] = (e, time.time() - t0)

    threads = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(calls)]
    for t in threads:
        t.start()
    waker = wake_later(fleet, 1.5)
    for t in threads:
        t.join(60)
    waker.join()
    for i, (r, secs) in enumerate(out):
        assert not isinstance(r, Exception), f"call {i}: {r!r}"
        assert secs >= 1.0, f"call {i} was not held ({secs:.2f} s)"
    return [r for r, _ in out]


def test_both_sdks_are_held_then_served(fleet):
    site(fleet, "60s")
    oa = openai.OpenAI(base_url=fleet.base + "/v1", api_key="x", max_retries=0, timeout=30)
    an = anthropic.Anthropic(base_url=fleet.base, api_key="x", max_retries=0, timeout=30)
    r, m = held_together(fleet, [
        lambda: oa.chat.completions.create(model="sdk-model", messages=[{"role": "user", "content": "hi"}]),
        lambda: an.messages.create(model="sdk-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}]),
    ])
    assert r.usage.completion_tokens == 5
    assert m.usage.output_tokens == 5


def test_held_streams_for_both_sdks(fleet):
    site(fleet, "60s")
    oa = openai.OpenAI(base_url=fleet.base + "/v1", api_key="x", max_retries=0, timeout=30)
    an = anthropic.Anthropic(base_url=fleet.base, api_key="x", max_retries=0, timeout=30)

    def openai_stream():
        return "".join(c.choices[0].delta.content or "" for c in
                       oa.chat.completions.create(model="sdk-model", stream=True,
                                                  messages=[{"role": "user", "content": "hi"}])
                       if c.choices)

    def anthropic_stream():
        with an.messages.stream(model="sdk-model", max_tokens=5,
                                messages=[{"role": "user", "content": "hi"}]) as s:
            return "".join(s.text_stream)

    a, b = held_together(fleet, [openai_stream, anthropic_stream])
    assert a, "the keepalive comments are skipped, the events arrive (OpenAI)"
    assert b, "the keepalive comments are skipped, the events arrive (Anthropic)"


def test_what_each_sdk_makes_of_a_late_error(fleet):
    site(fleet, "1s", keepalive="200ms")
    oa = openai.OpenAI(base_url=fleet.base + "/v1", api_key="x", max_retries=0, timeout=30)
    # Non-streaming: the 200 body is the error envelope after spaces. The
    # OpenAI SDK does not raise: it returns an object with no choices.
    r = oa.chat.completions.create(model="sdk-model", messages=[{"role": "user", "content": "hi"}])
    assert not getattr(r, "choices", None)
    extra = r.model_extra or {}
    assert extra.get("error", {}).get("code") == "model_waking", extra
    # Streaming: the data: {"error": ...} event raises APIError.
    with pytest.raises(openai.APIError) as e:
        list(oa.chat.completions.create(model="sdk-model", stream=True, messages=[{"role": "user", "content": "hi"}]))
    assert "is waking" in str(e.value)
    an = anthropic.Anthropic(base_url=fleet.base, api_key="x", max_retries=0, timeout=30)
    # Non-streaming Anthropic: also no exception, a Message without content.
    m = an.messages.create(model="sdk-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert not getattr(m, "content", None)
    # Streaming Anthropic: the error event raises.
    with pytest.raises(anthropic.APIError) as e:
        with an.messages.stream(model="sdk-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}]) as s:
            for _ in s:
                pass
    assert "model_waking" in str(e.value)
