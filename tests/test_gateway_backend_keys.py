"""Per-backend API keys (`glmserve gateway --backend-key URL=ENVVAR`): a real gateway process in front of a fake
provider endpoint (tests/fake_backend.py --provider: every path needs its own Bearer key, and it has no
/v1/health) and an open fake backend, driven by the official `openai` client with the gateway's own key. The
provider gets only its key, on requests and probes; no backend ever sees the client's key."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import openai
import pytest
from server_process import listening_process, wait_for

from glmserve.errors import InvalidRequestError
from glmserve.gateway.app import build_proxy
from glmserve.gateway.backends import backend_keys
from glmserve.gateway.proxy_options import ProxyOptions
from glmserve.gateway.settings import GatewaySettings

FAKE_BACKEND = Path(__file__).with_name("fake_backend.py")
PROVIDER_SECRET = "sk-provider-secret-0123456789"
CLIENT_KEY = "sk-team-client-0123456789"


def test_backend_gets_its_own_key_and_never_the_clients(tmp_path: Path) -> None:
    (tmp_path / "keys.toml").write_text(f'[[key]]\nname = "team"\nkey = "{CLIENT_KEY}"\n')
    env = {**os.environ, "BENCH_PROVIDER_KEY": PROVIDER_SECRET}
    with listening_process([sys.executable, str(FAKE_BACKEND), "--name", "prov", "--provider", "BENCH_PROVIDER_KEY"],
                           tmp_path / "prov.log", env=env) as provider, \
            listening_process([sys.executable, str(FAKE_BACKEND), "--name", "open"], tmp_path / "open.log") as open_:
        (tmp_path / "models.toml").write_text(f'[pools]\nprov = ["{provider.base_url}"]\n'
                                              '[models."provider/m"]\nmodel = "m"\npool = "prov"\n'
                                              '[models."local/m"]\nmodel = "m"\n')
        argv = [sys.executable, "-m", "glmserve.cli", "gateway", "--port", "0", "--probe-interval", "0.2",
                "--backend", open_.base_url, "--models", str(tmp_path / "models.toml"),
                "--backend-key", f"{provider.base_url}/=BENCH_PROVIDER_KEY", "--keys", str(tmp_path / "keys.toml"),
                "--ledger", f"sqlite:///{tmp_path / 'ledger.sqlite3'}"]
        with listening_process(argv, tmp_path / "gateway.log", env=env) as gw:
            def both_healthy() -> bool:
                backends = httpx.get(f"{gw.base_url}/v1/health").json().get("backends", [])
                return len(backends) == 2 and all(b["healthy"] for b in backends)

            wait_for(both_healthy, 30, "both backends healthy (the provider through /v1/models)", gw.log)
            client = openai.OpenAI(base_url=f"{gw.base_url}/v1", api_key=CLIENT_KEY, max_retries=0, timeout=30)
            reply = client.chat.completions.create(model="provider/m", messages=[{"role": "user", "content": "hi"}])
            assert reply.system_fingerprint == "prov" and reply.model == "provider/m"
            chunks = list(client.chat.completions.create(model="provider/m", stream=True,
                                                         messages=[{"role": "user", "content": "hi"}]))
            assert {c.system_fingerprint for c in chunks} == {"prov"}
            local = client.chat.completions.create(model="local/m", messages=[{"role": "user", "content": "hi"}])
            assert local.system_fingerprint == "open"

            seen_by_provider = httpx.get(f"{provider.base_url}/control").json()["authorizations"]
            seen_by_open = httpx.get(f"{open_.base_url}/control").json()["authorizations"]
            # probes (/v1/health -> 404 -> /v1/models, /metrics) and both completions carried the provider's key
            assert seen_by_provider and set(seen_by_provider) == {f"Bearer {PROVIDER_SECRET}"}
            assert len(seen_by_open) >= 2 and set(seen_by_open) == {None}  # no key at all: not the client's
            with pytest.raises(openai.AuthenticationError):  # the gateway still checks the client's key
                openai.OpenAI(base_url=f"{gw.base_url}/v1", api_key=PROVIDER_SECRET, max_retries=0).models.list()


def test_backend_key_errors_are_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"SET": "sk-x"}
    assert backend_keys(["https://api.example.com/v1/=SET"], env) == {"https://api.example.com/v1": "sk-x"}
    for spec, message in (("api.example.com=SET", "expected URL=ENVVAR"), ("https://a.example=", "URL=ENVVAR"),
                          ("https://a.example=NOT-A-NAME", "URL=ENVVAR"), ("https://a.example=UNSET", "UNSET is not")):
        with pytest.raises(InvalidRequestError, match=message):
            backend_keys([spec], env)
    with pytest.raises(InvalidRequestError, match="given twice"):
        backend_keys(["https://a.example=SET", "https://a.example/=SET"], env)
    monkeypatch.setenv("GLMSERVE_TEST_BACKEND_KEY", "sk-y")
    proxy = build_proxy(GatewaySettings(backend_urls=["http://127.0.0.1:1"]),
                        ProxyOptions(backend_keys=("http://127.0.0.1:2=GLMSERVE_TEST_BACKEND_KEY",)))
    with pytest.raises(InvalidRequestError, match="names no backend"):
        proxy.pool.check_keys()
