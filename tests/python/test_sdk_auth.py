"""Client keys and quotas through the official SDKs: a valid key works
(OpenAI sends it as a Bearer token, Anthropic as x-api-key), a wrong key
raises AuthenticationError, a model outside the allowlist raises
PermissionDeniedError, and a rate-limited key is retried by the SDK itself
after our Retry-After and succeeds."""
import hashlib
import os
import time

import anthropic
import openai
import pytest

GOOD, LIMITED, RL = "sk-sdk-good", "sk-sdk-limited", "sk-sdk-ratelimited"


def sha(k):
    return hashlib.sha256(k.encode()).hexdigest()


@pytest.fixture
def keyed(fleet):
    with open(os.path.join(fleet.tmp, "auth.yaml"), "w") as f:
        f.write(f"""api:
  mode: api-key
  keys:
    - key_hash: "{sha(GOOD)}"
      metadata: {{name: good, owner: acme}}
    - key_hash: "{sha(LIMITED)}"
      metadata: {{name: limited, owner: beta}}
      models: [other-model]
    - key_hash: "{sha(RL)}"
      metadata: {{name: rl, owner: gamma}}
      quota: {{requests_per_minute: 60}}
""")
    # Burst of one request, one more per second: the second request in a
    # row is refused with Retry-After: 1 (retry-after-ms ~1000).
    fleet.router("--shards", "2", "--auth-config-file", "auth.yaml", env={"HIVENET_ROUTER_RPM_BURST_SECONDS": "1"})
    sim = fleet.sim("sdk-model", "--output-tokens", "5")
    fleet.agent(sim, "a.key")
    fleet.wait_agents("sdk-model", 1)
    return fleet


def test_openai_keys_allowlist_and_retry_after(keyed):
    ok = openai.OpenAI(base_url=keyed.base + "/v1", api_key=GOOD, max_retries=0)
    r = ok.chat.completions.create(model="sdk-model", messages=[{"role": "user", "content": "hi"}])
    assert r.usage.completion_tokens == 5
    assert [m.id for m in ok.models.list()] == ["sdk-model"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.base + "/v1", api_key="sk-wrong", max_retries=0).chat.completions.create(
            model="sdk-model", messages=[{"role": "user", "content": "hi"}])
    limited = openai.OpenAI(base_url=keyed.base + "/v1", api_key=LIMITED, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as e:
        limited.chat.completions.create(model="sdk-model", messages=[{"role": "user", "content": "hi"}])
    assert "does not have access to model: sdk-model" in str(e.value)
    assert [m.id for m in limited.models.list()] == []

    # Without retries the second request in a row is refused...
    once = openai.OpenAI(base_url=keyed.base + "/v1", api_key=RL, max_retries=0)
    once.chat.completions.create(model="sdk-model", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.RateLimitError) as e:
        once.chat.completions.create(model="sdk-model", messages=[{"role": "user", "content": "hi"}])
    assert e.value.response.headers.get("retry-after") == "1"
    # ...with the SDK's own retry it waits as told and succeeds.
    time.sleep(1.1)
    retrying = openai.OpenAI(base_url=keyed.base + "/v1", api_key=RL, max_retries=2)
    retrying.chat.completions.create(model="sdk-model", messages=[{"role": "user", "content": "hi"}])
    t0 = time.monotonic()
    r = retrying.chat.completions.create(model="sdk-model", messages=[{"role": "user", "content": "hi"}])
    waited = time.monotonic() - t0
    assert r.usage.completion_tokens == 5
    assert 0.7 <= waited < 3.0, waited
    m = keyed.metrics_text()
    assert 'hivenet_tenant_rate_limited_total{tenant_id="gamma"' in m


def test_anthropic_keys_allowlist_and_retry_after(keyed):
    ok = anthropic.Anthropic(base_url=keyed.base, api_key=GOOD, max_retries=0)
    msg = ok.messages.create(model="sdk-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert msg.usage.output_tokens == 5
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=keyed.base, api_key="sk-wrong", max_retries=0).messages.create(
            model="sdk-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.PermissionDeniedError):
        anthropic.Anthropic(base_url=keyed.base, api_key=LIMITED, max_retries=0).messages.create(
            model="sdk-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    retrying = anthropic.Anthropic(base_url=keyed.base, api_key=RL, max_retries=2)
    retrying.messages.create(model="sdk-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    t0 = time.monotonic()
    with retrying.messages.stream(model="sdk-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}]) as s:
        text = "".join(s.text_stream)
    waited = time.monotonic() - t0
    assert text
    assert 0.7 <= waited < 3.0, waited
