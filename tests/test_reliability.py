"""Hostile input against a real `glmserve serve` process (a tiny random Llama with a chat template): request
limits named with their flags, bad values that must be 4xx and never 5xx, fuzzing from the server's own OpenAPI
schema (bench/fuzz_api.py), streams aborted at random points, session ids that stay in their directory, request
ids in the `x-request-id` header and in every JSON log line, and the startup lines.

One server serves the module; it runs with small limits so that each is easy to reach, JSON logs at debug level
(the engine thread's lines for each request), and a session store in a temp directory. Afterwards the engine
must be idle with every KV block free.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_process import STARTUP_TIMEOUT_S, ServerProcess, glmserve_process, wait_for
from tiny_models import make_tiny_chat_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from fuzz_api import FUZZ_SERVER_FLAGS, check_answer, engine_idle, fuzz  # noqa: E402

LIMITS = {"--max-body-bytes": 65536, "--max-messages": 8, "--max-prompt-tokens": 96, "--max-n": 2,
          "--max-logprobs": 3, "--max-stop-strings": 2, "--max-stop-length": 8}
USER = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("reliability")
    model = make_tiny_chat_model("llama", root / "model")
    args = ["--model", str(model), *FUZZ_SERVER_FLAGS, "--log-format", "json", "--log-level", "debug",
            "--session-store", str(root / "sessions"), "--kv-chunk-tokens", "64"]
    for name, value in LIMITS.items():
        args = [*args, name, str(value)]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("GLMSERVE_TORCH_ONLY", "1")  # the HTTP layer is under test: no C++ kernel to build or load
        with glmserve_process(args, root / "server.log") as process:
            env.undo()
            wait_for(lambda: httpx.get(f"{process.base_url}/v1/health").status_code == 200, STARTUP_TIMEOUT_S,
                     "readiness", process.log)
            yield process


def post(server: ServerProcess, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", timeout=60, **kwargs)


def openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert check_answer(response.status_code, response.content) is None, response.text
    return response.json()["error"]


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": USER, "max_tokens": 2, **extra}


# ---------------------------------------------------------------------- limits

@pytest.mark.parametrize(("body", "flag", "param"), [
    (chat(messages=USER * 9), "--max-messages", "messages"),
    (chat(messages=[{"role": "user", "content": "fox " * 200}]), "--max-prompt-tokens", "messages"),
    (chat(n=3), "--max-n", "n"),
    (chat(logprobs=True, top_logprobs=4), "--max-logprobs", "top_logprobs"),
    (chat(stop=["a", "b", "c"]), "--max-stop-strings", "stop"),
    (chat(stop="a much longer stop"), "--max-stop-length", "stop"),
], ids=["messages", "prompt-tokens", "n", "top-logprobs", "stop-count", "stop-length"])
def test_chat_over_a_limit_is_400_naming_the_flag(server: ServerProcess, body: dict, flag: str, param: str) -> None:
    error = openai_error(post(server, "/v1/chat/completions", json=body), 400)
    assert flag in error["message"] and error["param"] == param and error["code"] == "request_limit_exceeded"


def test_completions_limits(server: ServerProcess) -> None:
    base = {"model": "tiny", "max_tokens": 1}
    error = openai_error(post(server, "/v1/completions", json={**base, "prompt": ["a", "b", "c"]}), 400)
    assert "--max-n" in error["message"] and "prompts x n" in error["message"]
    error = openai_error(post(server, "/v1/completions", json={**base, "prompt": "x", "logprobs": 5}), 400)
    assert "--max-logprobs" in error["message"] and error["param"] == "logprobs"
    error = openai_error(post(server, "/v1/completions", json={**base, "prompt": list(range(2, 120))}), 400)
    assert "--max-prompt-tokens" in error["message"] and error["param"] == "prompt"
    # at the limits: answered
    at_limit = {**base, "prompt": list(range(2, 98)), "n": 2, "logprobs": 3, "stop": ["12345678", "b"]}
    assert post(server, "/v1/completions", json=at_limit).status_code == 200


def test_body_over_the_limit_is_413_declared_or_chunked(server: ServerProcess) -> None:
    big = json.dumps(chat(messages=[{"role": "user", "content": "x" * 70000}])).encode()
    error = openai_error(post(server, "/v1/chat/completions", content=big,
                              headers={"content-type": "application/json"}), 413)
    assert "--max-body-bytes" in error["message"] and error["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: read only up to the limit
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    chunked = post(server, "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "--max-body-bytes" in openai_error(chunked, 413)["message"]


def test_limit_through_the_openai_client(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, n=3)
    assert info.value.status_code == 400 and "--max-n" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:  # as OpenAI: a user message needs content
        client.chat.completions.create(model="tiny", messages=[{"role": "user"}], max_tokens=2)  # type: ignore
    assert "content" in info.value.message


# ---------------------------------------------------------------------- hostile values: 4xx, never 5xx

def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


HOSTILE = {
    "user message without content": (b'{"model":"tiny","messages":[{"role":"user"}]}', 400),
    "system message with null content": (b'{"model":"tiny","messages":[{"role":"system","content":null}]}', 400),
    "NaN temperature": (b'{"model":"tiny","messages":[{"role":"user","content":"a"}],"temperature":NaN}', 400),
    "inf logit bias": (b'{"model":"tiny","messages":[{"role":"user","content":"a"}],"logit_bias":{"5":Infinity}}',
                       400),
    "NaN sparse threshold": (b'{"model":"tiny","messages":[{"role":"user","content":"a"}],'
                             b'"sparse_attention":{"threshold":NaN}}', 400),
    "invalid UTF-8": (b'{"model":"tiny","prompt":"\xff\xfe\xc3"}', 400),
    "deep nesting": (('{"model":"tiny","prompt":"a","guided_json":' + _nested(30000) + "}").encode(), 400),
    "deep nesting in a known field": (('{"model":"tiny","prompt":' + _nested(5000) + "}").encode(), 400),
    "unknown model": (b'{"model":"gpt-9","messages":[{"role":"user","content":"a"}]}', 404),
    "empty chat": (b'{"model":"tiny","messages":[]}', 400),
    "negative max_tokens": (b'{"model":"tiny","prompt":"a","max_tokens":-5}', 400),
    "string n": (b'{"model":"tiny","prompt":"a","n":"many"}', 400),
    "negative n": (b'{"model":"tiny","prompt":"a","n":-1}', 400),
    "session id with a path": (b'{"model":"tiny","prompt":"a","max_tokens":1,"session_id":"../../etc/passwd"}', 400),
    "not an object": (b'[1, 2, 3]', 400),
    "negative token id with echo": (b'{"model":"tiny","prompt":[-5, 3],"echo":true,"max_tokens":1}', 400),
    "empty body": (b"", 400),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_request_is_4xx_in_openai_format(server: ServerProcess, name: str) -> None:
    body, status = HOSTILE[name]
    path = "/v1/chat/completions" if b"messages" in body or body in (b"", b"[1, 2, 3]") else "/v1/completions"
    openai_error(post(server, path, content=body, headers={"content-type": "application/json"}), status)


@pytest.mark.parametrize("session_id", ["../escape", "a/b", "..%2F..%2Fetc", "x" * 129, "a b"])
def test_bad_session_ids_are_4xx(server: ServerProcess, session_id: str) -> None:
    response = post(server, "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 1},
                    headers={"X-Session-Id": session_id})
    assert openai_error(response, 400)["param"] == "session_id"
    got = httpx.get(f"{server.base_url}/v1/sessions/{session_id}", timeout=30)
    assert 400 <= got.status_code < 500 and check_answer(got.status_code, got.content) is None


def test_session_ids_never_leave_the_store_directory(server: ServerProcess, tmp_path: Path) -> None:
    store = server.log_path.parent / "sessions"
    outside = sorted({p.name for p in store.parent.iterdir()} | {store.name})  # the store is made on first use
    ids = ("..", "...", ".", "a:b@c", "-rf", "....")
    saves = _metric(server, "glmserve_session_saves_total")
    for session_id in ids:
        response = post(server, "/v1/completions", json={"model": "tiny", "prompt": "The quick brown fox " * 6,
                                                         "max_tokens": 1, "session_id": session_id})
        assert response.status_code == 200, response.text
    wait_for(lambda: _metric(server, "glmserve_session_saves_total") >= saves + len(ids), 30,
             "every session to be saved", server.log)
    assert sorted(p.name for p in store.parent.iterdir()) == outside  # nothing new next to the store
    names = [p.relative_to(store) for p in store.rglob("*")]
    assert names and all(".." not in p.parts and not p.name.startswith(".") for p in names)


def _metric(server: ServerProcess, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


# ---------------------------------------------------------------------- fuzzing and aborted streams

def test_fuzzing_from_the_openapi_schema_gets_no_5xx(server: ServerProcess) -> None:
    """A bounded run (`python bench/fuzz_api.py --cases 3000` is the long one)."""
    report = fuzz(server.base_url, cases=int(os.environ.get("GLMSERVE_FUZZ_CASES", "50")), seed=3)
    assert not report.failures, "\n".join(report.failures)
    assert report.statuses[200] > 0 and sum(n for s, n in report.statuses.items() if s != 200) > 0
    engine_idle(server.base_url)


async def _abort_streams(base_url: str, count: int, concurrency: int, seed: int) -> int:
    """Opens `count` streams, `concurrency` at a time, each left after a random number of chunks (0: before
    the first one) and sent with the request id `abort-{seed}-{i}`; returns how many ran to the end."""
    rng = random.Random(seed)
    plan = [rng.randint(0, 12) for _ in range(count)]
    completed = 0
    gate = asyncio.Semaphore(concurrency)

    async def one(http: httpx.AsyncClient, leave_after: int, i: int) -> None:
        nonlocal completed
        body = {"model": "tiny", "prompt": f"stream {i} " * rng.randint(1, 8), "max_tokens": 4,
                "stream": True, "ignore_eos": True}
        headers = {"x-request-id": f"abort-{seed}-{i}"}
        async with gate, http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            assert response.status_code in (200, 503), await response.aread()
            seen = 0
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    completed += 1
                    return
                seen += line.startswith("data: ")
                if seen >= leave_after:
                    return  # leaving the `async with` closes the connection mid-stream

    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        await asyncio.gather(*(one(http, leave_after, i) for i, leave_after in enumerate(plan)))
    return completed


def test_streams_aborted_at_random_points_leave_the_pool_idle(server: ServerProcess) -> None:
    count = int(os.environ.get("GLMSERVE_ABORTED_STREAMS", "60"))
    completed = asyncio.run(_abort_streams(server.base_url, count, concurrency=8, seed=5))
    assert 0 < completed < count  # some ran to the end, the others were cut at random points
    engine_idle(server.base_url)
    # the engine thread's abort lines name the HTTP request that was left
    aborts = [r for r in _log_records(server) if r["logger"] == "glmserve.engine.llm_engine" and " aborted " in
              r["message"]]
    assert all(r["request_id"].startswith("abort-5-") and r["thread"] == "glmserve-engine" for r in aborts), aborts


@pytest.mark.slow
def test_thousand_streams_aborted_at_random_points_leave_the_pool_idle(server: ServerProcess) -> None:
    completed = asyncio.run(_abort_streams(server.base_url, 1000, concurrency=16, seed=6))
    assert 0 < completed < 1000
    engine_idle(server.base_url)


# ---------------------------------------------------------------------- request ids, logs, startup

def _log_records(server: ServerProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]


def test_request_id_header_is_honoured_or_made_and_in_every_log_line(server: ServerProcess) -> None:
    given = post(server, "/v1/chat/completions", json=chat(), headers={"x-request-id": "trace-42"})
    assert given.status_code == 200 and given.headers["x-request-id"] == "trace-42"
    made = post(server, "/v1/chat/completions", json=chat(n=5), headers={"x-request-id": "bad id\twith space"})
    assert made.status_code == 400 and len(made.headers["x-request-id"]) == 32  # not the invalid one given
    assert httpx.get(f"{server.base_url}/health").headers["x-request-id"]

    def logged(rid: str) -> list[dict[str, Any]]:
        return [r for r in _log_records(server) if r["request_id"] == rid]

    wait_for(lambda: logged("trace-42") and logged(made.headers["x-request-id"]), 10, "the access lines", server.log)
    access = [r for r in logged("trace-42") if r["logger"] == "uvicorn.access"]
    assert access and "POST /v1/chat/completions" in access[0]["message"]
    # every line is a JSON object with the same fields (output that is no log record would break collectors)
    lines = [line for line in server.log().splitlines() if line.strip()]
    assert lines and all(line.startswith("{") for line in lines), [x for x in lines if not x.startswith("{")][:5]
    assert all({"time", "level", "logger", "request_id", "message"} <= set(r) for r in _log_records(server))


def test_engine_thread_lines_carry_the_request_id_sent(server: ServerProcess) -> None:
    """The context variable of the HTTP request does not reach the engine thread: the id travels with the request
    and the engine names it in what it logs about that request (here its debug lines: added, finished)."""
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60,
                      headers={"x-request-id": "trace-engine-7"}) as response:
        assert response.status_code == 200 and response.read().decode().endswith("data: [DONE]\n\n")

    def engine_lines() -> list[dict[str, Any]]:
        return [r for r in _log_records(server) if r["logger"] == "glmserve.engine.llm_engine"
                and r["request_id"] == "trace-engine-7"]

    wait_for(lambda: len(engine_lines()) >= 2, 30, "the engine's lines about the request", server.log)
    added, finished = engine_lines()[:2]
    assert " added: " in added["message"] and " finished (" in finished["message"]
    assert added["thread"] == finished["thread"] == "glmserve-engine"
    # a line about no request still says so
    assert any(r["request_id"] == "-" and r["thread"] == "glmserve-engine" for r in _log_records(server))


def test_startup_logs_each_stage_with_timings(server: ServerProcess) -> None:
    messages = [r["message"] for r in _log_records(server) if r["message"].startswith("startup:")]
    assert [m.split()[1] for m in messages] == ["loading", "model", "KV", "warm-up"], messages
    model, pool, warm = messages[1:]
    assert "float32" in model and " MB " in model and " s:" in model
    assert "blocks x 16 tokens" in pool and "MB" in pool
    assert "ready after" in warm


def test_non_loopback_host_without_keys_logs_a_warning(server: ServerProcess, tmp_path: Path) -> None:
    """The warning comes before the model loads; the server is stopped once it is seen."""
    log = tmp_path / "open.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "glmserve.cli", "serve", "--host", "0.0.0.0", "--port", "0",
                                 "--model", str(server.log_path.parent / "model")], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "GLMSERVE_TORCH_ONLY": "1"})
    try:
        wait_for(lambda: "startup: loading" in log.read_text(), STARTUP_TIMEOUT_S, "the first startup line",
                 log.read_text)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    text = log.read_text()
    assert text.index("listening on 0.0.0.0 without API keys (--keys FILE)") < text.index("startup: loading")
