"""What the official SDKs do with our cross-site 307 (spec 07 §5.5): two
routers on loopback as sites a and b (different ports, same host), the
model's agent only at b, a sibling map pushed to a. Both SDKs follow the
307 (their httpx clients follow redirects, and 307 keeps POST and the
body). Across a port change httpx drops `Authorization` (another port is
another origin), and both SDKs send their key as `Authorization: Bearer`
(anthropic 2.x included), so with client keys on, b answers 401 to both.
These are measured here and written in the README: if an SDK changes,
this fails."""
import hashlib
import json
import os
import time
import urllib.request

import anthropic
import openai
import pytest

from conftest import get_json, wait_until

KEY = "sk-sdk-redirect"
ADMIN = "test-admin-key"


def sha(k):
    return hashlib.sha256(k.encode()).hexdigest()


def push_map(base, a_url, b_url):
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    body = {
        "version": now, "hints_generated_at": now,
        "sites": [{"site_id": "a", "base_url": a_url}, {"site_id": "b", "base_url": b_url}],
        "placements": [{"site_id": s, "model": "sdk-model", "kind": "chat", "warm": s == "b"} for s in ("a", "b")],
    }
    req = urllib.request.Request(base + "/admin/sibling-map", data=json.dumps(body).encode(), method="PUT",
                                 headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200


def two_sites(fleet, *auth):
    os.makedirs(os.path.join(fleet.tmp, "a"), exist_ok=True)
    fleet.router("--site-id", "a", "--disk-db-path", "a/db", "--identity-path", "a/id.key", *auth)
    a = fleet.base
    fleet.router("--site-id", "b", "--disk-db-path", "b/db", "--identity-path", "b/id.key", *auth)
    b = fleet.base
    sim = fleet.sim("sdk-model", "--output-tokens", "5")
    fleet.agent(sim, "agent.key")
    fleet.wait_agents("sdk-model", 1)
    push_map(a, a, b)
    return a, b


def served_at_b(fleet):
    return sum(float(l.split()[-1]) for l in fleet.metrics_text().splitlines()
               if l.startswith("hivenet_routing_requests_routed_total") and 'model="sdk-model"' in l)


def test_both_sdks_follow_the_redirect_without_auth(fleet):
    a, b = two_sites(fleet)
    oa = openai.OpenAI(base_url=a + "/v1", api_key="unused", max_retries=0)
    r = oa.chat.completions.create(model="sdk-model", messages=[{"role": "user", "content": "hi"}])
    assert r.usage.completion_tokens == 5
    an = anthropic.Anthropic(base_url=a, api_key="unused", max_retries=0)
    m = an.messages.create(model="sdk-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert m.usage.output_tokens == 5
    assert served_at_b(fleet) == 2, "both were served at b after the 307"


def test_both_sdks_lose_their_key_across_ports(fleet):
    with open(os.path.join(fleet.tmp, "auth.yaml"), "w") as f:
        f.write(f'api:\n  mode: api-key\n  keys:\n    - key_hash: "{sha(KEY)}"\n      metadata: {{name: k, owner: t}}\n')
    a, b = two_sites(fleet, "--auth-config-file", "auth.yaml")
    oa = openai.OpenAI(base_url=a + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        oa.chat.completions.create(model="sdk-model", messages=[{"role": "user", "content": "hi"}])
    an = anthropic.Anthropic(base_url=a, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        an.messages.create(model="sdk-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    # The same key straight at b works: it is the redirect that lost it.
    direct = openai.OpenAI(base_url=b + "/v1", api_key=KEY, max_retries=0)
    assert direct.chat.completions.create(model="sdk-model", messages=[{"role": "user", "content": "hi"}]).usage.completion_tokens == 5
