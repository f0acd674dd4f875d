"""`glmserve serve` with the gateway inside (keys, limits, billing) on a tiny random-weight model, driven by the
official `openai` client: 401 without a key, usage billed to the SQLite ledger streamed or not, the server's
effective max_tokens and its source in the headers and metrics (the output budget a server cap took), the
gateway's metrics beside the server's, `glmserve billing report` over the same ledger; and without --keys, usage
lands in the ledger under the anonymous key."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from server_process import STARTUP_TIMEOUT_S, ServerProcess, glmserve_process, listening_process, wait_for
from tiny_models import make_tiny_chat_model

from glmserve.gateway.backends import BackendPool
from glmserve.gateway.ledger import Ledger
from glmserve.gateway.proxy_metrics import ProxyMetrics

DASHBOARD_DIR = Path(__file__).resolve().parents[1] / "docs" / "grafana"
FAKE_BACKEND = Path(__file__).with_name("fake_backend.py")
SERVED = "tiny"
CAP = 6
KEY = "sk-team-a-0123456789"
PRICES = '''
version = "serve-1"
[[model]]
name = "tiny"
[[model.tier]]
input = "3.0"
cached_input = "0.3"
output = "15.0"
'''


def _ready(process: ServerProcess) -> None:
    def ready() -> bool:
        return httpx.get(f"{process.base_url}/v1/health").status_code == 200

    wait_for(ready, STARTUP_TIMEOUT_S, "readiness", process.log)


def _metric(base_url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    work = tmp_path_factory.mktemp("serve-gateway")
    model = make_tiny_chat_model("llama", work / "model")  # a chat template, for POST /v1/responses
    (work / "keys.toml").write_text(f'[[key]]\nname = "team-a"\nkey = "{KEY}"\nrpm = 1000\ntpm = 100000\n')
    (work / "prices.toml").write_text(PRICES)
    ledger = work / "ledger.sqlite3"
    args = ["--model", str(model), "--served-model-name", SERVED, "--max-model-len", "128", "--request-timeout", "60",
            "--kv-cache-memory-bytes", str(8 << 20), "--num-threads", "1", "--max-tokens-cap", str(CAP),
            "--keys", str(work / "keys.toml"), "--prices", str(work / "prices.toml"), "--ledger", f"sqlite:///{ledger}"]
    with glmserve_process(args, work / "server.log") as process:
        _ready(process)
        yield process, ledger


def test_serve_bills_through_the_gateway_and_reports_the_token_budget(served) -> None:
    process, ledger_path = served
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{process.base_url}/v1", api_key="sk-nope", max_retries=0).completions.create(
            model=SERVED, prompt="hello", max_tokens=3)
    client = openai.OpenAI(base_url=f"{process.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    raw = client.completions.with_raw_response.create(model=SERVED, prompt="hello there", max_tokens=20,
                                                      extra_body={"ignore_eos": True})
    whole = raw.parse()
    assert raw.headers["x-glmserve-max-tokens"] == str(CAP) and raw.headers["x-glmserve-max-tokens-source"] == \
        "server_cap" and raw.headers["x-glmserve-max-tokens-requested"] == "20"
    assert raw.headers["x-ratelimit-limit-requests"] == "1000" and "x-ratelimit-remaining-tokens" in raw.headers
    assert whole.usage.completion_tokens == CAP and whole.choices[0].finish_reason == "length"
    small = client.completions.with_raw_response.create(model=SERVED, prompt="hello there", max_tokens=2)
    assert small.headers["x-glmserve-max-tokens-source"] == "client"
    chunks = list(client.completions.create(model=SERVED, prompt="hello there", max_tokens=20, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert all(c.usage is None for c in chunks)  # the usage chunk the gateway asked for is not shown

    rows = {r.request_id: r for r in Ledger(f"sqlite:///{ledger_path}").rows()}
    assert len(rows) == 3 and {r.key_name for r in rows.values()} == {"team-a"}
    row = rows[whole.id]
    assert (row.prompt_tokens, row.completion_tokens) == (whole.usage.prompt_tokens, CAP)
    assert row.cached_tokens == whole.usage.prompt_tokens_details.cached_tokens
    streamed = rows[chunks[0].id]
    assert streamed.streamed and streamed.completion_tokens == CAP and streamed.prompt_tokens == row.prompt_tokens
    # same tokens, same price: the streamed request costs what the non-streamed one did (cache hits aside)
    if streamed.cached_tokens == row.cached_tokens:
        assert streamed.cost_micro == row.cost_micro

    base = process.base_url
    assert _metric(base, "glmserve_request_finished_by_limit_total", finish_reason="length",
                   limit_source="server_cap") == 2
    assert _metric(base, "glmserve_output_budget_lost_tokens_total") == 2 * (20 - CAP)
    assert _metric(base, "glmserve_gateway_auth_failures_total", reason="unknown") == 1
    assert _metric(base, "glmserve_gateway_key_tokens_total", key="team-a", kind="completion") == 2 * CAP + 2
    assert _metric(base, "glmserve_http_requests_total", endpoint="/v1/completions", status="401") == 1
    health = httpx.get(f"{base}/v1/health").json()
    assert health["gateway"]["backend"] == "memory" and health["gateway"]["keys"] == 1

    out = subprocess.run([sys.executable, "-m", "glmserve.cli", "billing", "report", "--ledger",
                          f"sqlite:///{ledger_path}"], capture_output=True, text=True, check=True).stdout
    assert "team-a" in out and "without_cache_usd" in out and "TOTAL" in out


def test_every_metric_of_the_grafana_dashboard_is_exported_and_its_json_is_current(served) -> None:
    """The dashboard's panels name metrics that exist (the serving process's /metrics: server, admission and
    --request-timeout metrics; the gateway's proxy registry), so no panel shows "no data" for a renamed metric, and
    docs/grafana/glmserve-gateway.json is what docs/grafana/dashboard.py writes."""
    process, _ = served
    sys.path.insert(0, str(DASHBOARD_DIR))
    try:
        import dashboard
    finally:
        sys.path.remove(str(DASHBOARD_DIR))
    assert json.loads((DASHBOARD_DIR / "glmserve-gateway.json").read_text()) == dashboard.dashboard()
    texts = [httpx.get(f"{process.base_url}/metrics").text,
             generate_latest(ProxyMetrics(BackendPool(httpx.AsyncClient(), 30, 3, 3, 5)).registry).decode()]
    exported = {family.name for text in texts for family in text_string_to_metric_families(text)}
    named = {metric.removesuffix("_total") for panel in dashboard.PANELS for metric in panel.metrics}
    assert named <= exported, sorted(named - exported)


def test_responses_are_billed_streamed_or_not_as_their_usage_says(served) -> None:
    """POST /v1/responses goes through admission and billing like chat: one ledger row per answered response, the
    Responses usage shape (input/output tokens, cached input) read whole and from `response.completed`."""
    process, ledger_path = served
    client = openai.OpenAI(base_url=f"{process.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    whole = client.responses.create(model=SERVED, input="hello there", max_output_tokens=4, store=False)
    events = list(client.responses.create(model=SERVED, input="hello there", max_output_tokens=4, store=False,
                                          stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")  # incomplete: cut at 4 tokens
    streamed = events[-1].response
    rows = {r.request_id: r for r in Ledger(f"sqlite:///{ledger_path}").rows()}
    for response, is_streamed in ((whole, False), (streamed, True)):
        row = rows[response.id]
        assert row.streamed is is_streamed and row.key_name == "team-a"
        assert (row.prompt_tokens, row.completion_tokens) == (response.usage.input_tokens, response.usage.output_tokens)
        assert row.cached_tokens == response.usage.input_tokens_details.cached_tokens
        assert row.completion_tokens > 0


# one request per route that reaches the engine (/v1/compress: the compressor; its body here is one the route
# itself refuses with a 400, so that a 401 shows the refusal came first)
GUARDED = [
    ("POST", "/v1/chat/completions", {"model": SERVED, "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"model": SERVED, "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2, "stream": True}),
    ("POST", "/v1/completions", {"model": SERVED, "prompt": "hello there", "max_tokens": 2}),
    ("POST", "/v1/completions", {"model": SERVED, "prompt": "hello there", "max_tokens": 2, "stream": True}),
    ("POST", "/v1/responses", {"model": SERVED, "input": "hello there", "max_output_tokens": 2, "store": False}),
    ("POST", "/v1/compress", {"documents": []}),
    ("GET", "/v1/sessions/some-session", None),
    ("DELETE", "/v1/sessions/some-session", None),
]
BAD_KEYS = [{}, {"Authorization": "Bearer sk-nope"}, {"Authorization": f"Bearer {KEY[:-1]}X"},
            {"Authorization": "Bearer"}, {"Authorization": f"Basic {KEY}"}, {"x-api-key": "sk-wrong"}, {"api-key": ""}]


def test_a_request_with_an_invalid_or_missing_key_never_reaches_the_engine(served) -> None:
    """Keys on: every route that reaches the engine answers 401 in OpenAI's format to a missing, unknown,
    mangled or malformed key, and the engine saw none of it: no request received, no prefix lookup, no prompt
    or generated token, no KV block taken, no ledger row."""
    process, ledger_path = served
    base = process.base_url

    def seen() -> tuple:
        engine = httpx.get(f"{base}/v1/health").json()["engine"]
        assert engine["num_free_blocks"] == engine["num_total_blocks"], engine
        return (engine["requests_received"], engine["prefix_cache_queries"], engine["num_preemptions"],
                _metric(base, "glmserve_prompt_tokens_total"), _metric(base, "glmserve_generation_tokens_total"),
                _metric(base, "glmserve_time_to_first_token_seconds_count"),
                len(Ledger(f"sqlite:///{ledger_path}").rows()))

    good = {"Authorization": f"Bearer {KEY}"}
    compress = httpx.post(f"{base}/v1/compress", json={"documents": []}, headers=good, timeout=60)
    assert compress.status_code == 400  # the route's own refusal, with a key
    before = seen()
    for method, path, body in GUARDED:
        for headers in BAD_KEYS:
            response = httpx.request(method, f"{base}{path}", json=body, headers=headers, timeout=60)
            assert response.status_code == 401, (method, path, headers, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"
    assert seen() == before
    # the same requests with the key do reach it
    assert httpx.post(f"{base}/v1/completions", json=GUARDED[2][2], headers=good, timeout=60).status_code == 200
    after = seen()
    assert after[0] == before[0] + 1 and after[3] > before[3]


def test_serve_without_keys_bills_the_anonymous_key(tiny_model_dir, tmp_path: Path, isolated_root: Path) -> None:
    args = ["--model", str(tiny_model_dir("llama")), "--served-model-name", SERVED, "--max-model-len", "128",
            "--kv-cache-memory-bytes", str(8 << 20), "--num-threads", "1"]
    with glmserve_process(args, tmp_path / "server.log") as process:
        _ready(process)
        client = openai.OpenAI(base_url=f"{process.base_url}/v1", api_key="anything", max_retries=0, timeout=60)
        done = client.completions.create(model=SERVED, prompt="hi", max_tokens=3)
        usage = httpx.get(f"{process.base_url}/v1/usage").json()
    rows = Ledger(f"sqlite:///{isolated_root / 'glmserve-cache' / 'ledger.sqlite3'}").rows()
    mine = [r for r in rows if r.request_id == done.id]
    assert len(mine) == 1 and mine[0].key_name == "anonymous" and mine[0].cost_micro == 0
    assert mine[0].completion_tokens == done.usage.completion_tokens
    assert usage["key"] == "anonymous" and usage["total"]["requests"] >= 1


def test_request_timeout_answers_504_aborts_the_engine_request_and_bills_nothing(tiny_model_dir, tmp_path: Path,
                                                                                 isolated_root: Path) -> None:
    """`--request-timeout 1` with one sequence at a time: of 16 requests of 500 tokens each (streamed or not) those
    still queued after 1 s get a 504 `request_timeout`; the engine ends with nothing in flight (the timed-out
    requests were aborted, not left to run) and the ledger holds a row for each answered request only."""
    ledger = tmp_path / "ledger.sqlite3"
    args = ["--model", str(tiny_model_dir("llama")), "--served-model-name", SERVED, "--max-model-len", "512",
            "--kv-cache-memory-bytes", str(16 << 20), "--num-threads", "1", "--max-num-seqs", "1",
            "--request-timeout", "1", "--ledger", f"sqlite:///{ledger}"]
    with glmserve_process(args, tmp_path / "server.log") as process:
        _ready(process)
        base = process.base_url

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=base, timeout=120) as http:
                return await asyncio.gather(*(http.post("/v1/completions", json={
                    "model": SERVED, "prompt": f"hello {i}", "max_tokens": 500, "ignore_eos": True,
                    "stream": i % 2 == 1}) for i in range(16)))

        responses = asyncio.run(run())
        timed_out = [r for r in responses if r.status_code == 504]
        assert timed_out and all(r.json()["error"]["code"] == "request_timeout" for r in timed_out)
        answered = [r for r in responses if r.status_code == 200]
        assert len(answered) + len(timed_out) == 16
        assert all(r.text.endswith("data: [DONE]\n\n") for r in answered if "text/event-stream" in r.headers[
            "content-type"])

        def idle() -> bool:
            engine = httpx.get(f"{base}/v1/health").json()["engine"]
            return engine["requests_in_flight"] == 0 and engine["num_free_blocks"] == engine["num_total_blocks"]

        wait_for(idle, 30, "the engine to drop the timed-out requests", process.log)
        assert _metric(base, "glmserve_request_timeouts_total", kind="request") == len(timed_out)
        assert _metric(base, "glmserve_generation_tokens_total") < 16 * 500  # the aborted ones did not run
    assert len(Ledger(f"sqlite:///{ledger}").rows()) == len(answered)


def test_a_standby_takes_what_a_full_server_refuses_and_is_billed_alike(tmp_path: Path, isolated_root: Path) -> None:
    """`serve --standby URL` with one sequence and one waiting slot: of 8 concurrent requests the ones the full
    queue refuses (a 503 before any byte) are answered by the standby (a fake OpenAI backend, probed on /v1/health)
    instead, so no client sees a 503; every answer, local or standby, has its ledger row under the caller's key;
    the standby's health and the routing counters are on the server's /metrics."""
    ledger = tmp_path / "ledger.sqlite3"
    (tmp_path / "keys.toml").write_text(f'[[key]]\nname = "team-a"\nkey = "{KEY}"\n')
    with listening_process([sys.executable, str(FAKE_BACKEND), "--name", "s"], tmp_path / "standby.log") as standby:
        model = make_tiny_chat_model("llama", tmp_path / "model")
        args = ["--model", str(model), "--served-model-name", SERVED, "--max-model-len", "512",
                "--kv-cache-memory-bytes", str(16 << 20), "--num-threads", "1", "--max-num-seqs", "1",
                "--max-waiting-requests", "1", "--standby", standby.base_url, "--probe-interval", "0.2",
                "--unhealthy-after", "2", "--keys", str(tmp_path / "keys.toml"), "--ledger", f"sqlite:///{ledger}"]
        with glmserve_process(args, tmp_path / "server.log") as process:
            _ready(process)
            base = process.base_url
            wait_for(lambda: _metric(base, "glmserve_gateway_backend_healthy", role="standby") == 1, 30,
                     "the standby's first probe", process.log)

            async def run() -> list[httpx.Response]:
                async with httpx.AsyncClient(base_url=base, timeout=120,
                                             headers={"Authorization": f"Bearer {KEY}"}) as http:
                    return await asyncio.gather(*(http.post("/v1/chat/completions", json={
                        "model": SERVED, "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 300,
                        "ignore_eos": True}) for i in range(8)))

            responses = asyncio.run(run())
            assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses]
            ids = [r.json()["id"] for r in responses]
            by_standby = [i for i in ids if i.startswith("chatcmpl-s-")]
            assert by_standby and len(by_standby) < 8  # the full queue's refusals went to the standby, not all
            assert _metric(base, "glmserve_gateway_routed_total", role="standby") == len(by_standby)
        rows = {r.request_id: r for r in Ledger(f"sqlite:///{ledger}").rows()}
    assert set(rows) == set(ids) and {r.key_name for r in rows.values()} == {"team-a"}
    assert all(rows[i].completion_tokens == 2 for i in by_standby)  # the fake standby's usage
