"""The OpenAI-compatible server, end to end: a real `glmserve serve` process on the embedded
SmolLM2, driven through the official `openai` package and raw httpx.

One server process serves the whole module (the model loads once). It is started with a
small admission bound (max_num_seqs 2 + max_waiting_requests 1 = 3 requests in flight) so
that overload is easy to reach, and the last test stops it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from parity import reference_logprobs, smollm2_reference
from prometheus_client.parser import text_string_to_metric_families
from server_process import STARTUP_TIMEOUT_S, glmserve_process, wait_for

SERVED = "smollm2"
ALIASES = {"gpt-4o-mini": SERVED, "openrouter/smollm2-135m": SERVED}
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 2
MAX_WAITING = 1
CAPACITY = MAX_NUM_SEQS + MAX_WAITING
BLOCK_SIZE = 16  # the server's default
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# a request that runs until it is aborted (ignore_eos, the whole context as budget)
ENDLESS = {"model": SERVED, "messages": QUESTION, "max_tokens": MAX_MODEL_LEN, "ignore_eos": True}


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log_path: Path
    early_readiness: httpx.Response  # /v1/health answered while the model was loading
    early_chat: httpx.Response  # a chat request sent while the model was loading
    ready_readiness: httpx.Response  # the first 200 of /v1/health

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def http(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=120, **kwargs)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    load_gate = log_path.with_name("load-gate")  # the model loads once the early requests were answered
    # float weights (`--quantization none`): the answers are compared with transformers' float model; the native
    # Q4_1 path of the default model is tested in test_quant_loading.py and test_cli.py
    args = ["--served-model-name", SERVED, "--max-model-len", str(MAX_MODEL_LEN), "--quantization", "none"]
    args += ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING)]
    args += ["--kv-cache-memory-bytes", str(256 << 20), "--shutdown-timeout", "20", "--num-threads", "1"]
    args += ["--kv-cache-dtype", "float32"]  # not the CPU default int8: prompt logprobs meet transformers' to 1e-3
    for alias, canonical in ALIASES.items():
        args += ["--alias", f"{alias}={canonical}"]
    with glmserve_process(args, log_path, load_gate) as process, \
            httpx.Client(base_url=process.base_url, timeout=30) as http:
        early_readiness = http.get("/v1/health")
        early_chat = http.post("/v1/chat/completions", json={"model": SERVED, "messages": QUESTION})
        load_gate.touch()

        def ready() -> httpx.Response | None:
            response = http.get("/v1/health")
            return response if response.status_code == 200 else None

        ready_readiness = wait_for(ready, STARTUP_TIMEOUT_S, "readiness", process.log)
        yield Server(process.proc, process.base_url, log_path, early_readiness, early_chat, ready_readiness)


def cached_when_seen(prompt_tokens: int) -> int:
    """`cached_tokens` of a prompt whose KV is all in the prefix cache: its full blocks, less the last token,
    which is always computed again (its logits give the first output token)."""
    return min(BLOCK_SIZE * (prompt_tokens // BLOCK_SIZE), prompt_tokens - 1)


def engine_state(server: Server) -> dict[str, Any]:
    with server.http() as http:
        return http.get("/v1/health").json()["engine"]


def wait_idle(server: Server, timeout_s: float = 20) -> dict[str, Any]:
    """Engine stats once no request is in flight and every KV block is back in the pool."""

    def idle() -> dict[str, Any] | None:
        state = engine_state(server)
        pool_full = state["num_free_blocks"] == state["num_total_blocks"]
        return state if state["requests_in_flight"] == 0 and state["num_running"] == 0 and pool_full else None

    return wait_for(idle, timeout_s, "the engine to go idle with all KV blocks free", server.log)


def scrape(server: Server) -> str:
    with server.http() as http:
        response = http.get("/metrics")
    assert response.status_code == 200
    return response.text


def metric(text: str, sample: str, **labels: str) -> float:
    """Value of one sample in Prometheus text (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def assert_openai_error(response: httpx.Response, status: int, error_type: str, code: str | None = None) -> str:
    assert response.status_code == status, response.text
    assert "Traceback" not in response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    return error["message"]


# ---------------------------------------------------------------------- health and models


def test_readiness_is_503_until_warm_up_then_200(server: Server) -> None:
    early = server.early_readiness
    assert early.status_code == 503
    assert early.headers["retry-after"] == "1"
    assert early.json()["status"] == "loading"
    assert_openai_error(server.early_chat, 503, "server_error", "model_not_ready")
    assert server.early_chat.headers["retry-after"] == "1"

    ready = server.ready_readiness.json()
    assert ready["status"] == "ready"
    assert ready["model"] == SERVED
    assert ready["engine"]["num_total_blocks"] > 0


def test_liveness(server: Server) -> None:
    with server.http() as http:
        response = http.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_models_list_served_model_and_aliases(server: Server) -> None:
    client = server.client()
    models = client.models.list().data
    assert [m.id for m in models] == [SERVED, *ALIASES]
    assert all(m.object == "model" and m.root == SERVED for m in models)
    assert client.models.retrieve("openrouter/smollm2-135m").id == "openrouter/smollm2-135m"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-5")
    assert info.value.code == "model_not_found"


# ---------------------------------------------------------------------- chat


def test_chat_completion(server: Server) -> None:
    response = server.client().chat.completions.create(
        model=SERVED, messages=QUESTION, max_tokens=8, temperature=0, user="test-user"
    )
    assert response.object == "chat.completion"
    assert response.model == SERVED
    assert response.id.startswith("chatcmpl-")
    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage.prompt_tokens > 10
    assert 0 < usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # cold, or every full block of a prompt seen before; the same request again hits all of them
    assert usage.prompt_tokens_details.cached_tokens in (0, cached_when_seen(usage.prompt_tokens))
    again = server.client().chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == cached_when_seen(usage.prompt_tokens)


def test_chat_stream_matches_non_stream(server: Server) -> None:
    client = server.client()
    request = {"model": SERVED, "messages": QUESTION, "max_tokens": 4, "temperature": 0}
    whole = client.chat.completions.create(**request, extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(
        **request,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.choices[0].message.content
    assert finishes == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached_when_seen(whole.usage.prompt_tokens)
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_stream_ends_with_done(server: Server) -> None:
    body = {"model": SERVED, "messages": QUESTION, "max_tokens": 3, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


def test_n2_returns_two_choices(server: Server) -> None:
    response = server.client().chat.completions.create(
        model=SERVED, messages=QUESTION, max_tokens=3, n=2, temperature=1.0, seed=1, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert all(c.message.content and c.finish_reason == "length" for c in response.choices)
    assert response.usage.completion_tokens == 6


def test_seed_reproducibility(server: Server) -> None:
    client = server.client()

    def sample(seed: int) -> list[str]:
        response = client.completions.create(
            model=SERVED, prompt="My favourite word is", max_tokens=5, temperature=1.0, n=2, seed=seed
        )
        return [c.text for c in response.choices]

    first = sample(1234)
    assert sample(1234) == first
    assert first[0] != first[1] or any(sample(seed) != first for seed in (1, 2))


def test_stop_string_cuts_text(server: Server) -> None:
    client = server.client()
    prompt = "1, 2, 3, 4, 5,"
    free = client.completions.create(model=SERVED, prompt=prompt, max_tokens=8, temperature=0).choices[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    cut = client.completions.create(model=SERVED, prompt=prompt, max_tokens=8, temperature=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]
    chat = client.chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=8, temperature=0, stop="Paris")
    assert chat.choices[0].finish_reason == "stop"
    assert "Paris" not in chat.choices[0].message.content


def test_chat_logprobs(server: Server) -> None:
    response = server.client().chat.completions.create(
        model=SERVED, messages=QUESTION, max_tokens=3, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = response.choices[0]
    content = choice.logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert "".join(t.token for t in content) == choice.message.content
    for token in content:
        assert token.logprob <= 0
        assert bytes(token.bytes).decode() == token.token
        assert len(token.top_logprobs) == 3
        values = [t.logprob for t in token.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert token.top_logprobs[0].token == token.token  # greedy: the chosen token is the top one
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob)


# ---------------------------------------------------------------------- completions


def test_completions_prompt_forms_and_echo(server: Server) -> None:
    client = server.client()
    prompts = ["The capital of France is", "Water is made of"]
    singles = [client.completions.create(model=SERVED, prompt=p, max_tokens=3, temperature=0) for p in prompts]
    assert singles[0].object == "text_completion"
    assert singles[0].id.startswith("cmpl-")

    both = client.completions.create(model=SERVED, prompt=prompts, max_tokens=3, temperature=0)
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [s.choices[0].text for s in singles]
    assert both.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert both.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)

    echoed = client.completions.create(model=SERVED, prompt=prompts[0], max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == prompts[0] + singles[0].choices[0].text


def test_completions_token_id_prompt_and_stream(server: Server) -> None:
    client = server.client()
    # SmolLM2's tokenizer: "Hello" -> 19556, "," -> 28, " my" -> 957, " name" -> 1462, " is" -> 314
    token_prompt = [19556, 28, 957, 1462, 314]
    by_ids = client.completions.create(model=SERVED, prompt=token_prompt, max_tokens=4, temperature=0)
    by_text = client.completions.create(model=SERVED, prompt="Hello, my name is", max_tokens=4, temperature=0)
    assert by_ids.usage.prompt_tokens == 5
    assert by_ids.choices[0].text == by_text.choices[0].text
    stream = client.completions.create(
        model=SERVED, prompt="Hello, my name is", max_tokens=4, temperature=0, stream=True, logprobs=1
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == by_text.choices[0].text
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices) == by_text.usage.completion_tokens


def test_completion_logprobs(server: Server) -> None:
    response = server.client().completions.create(
        model=SERVED, prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=2
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 3
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(3)]
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert value <= 0
        assert top[token] == pytest.approx(value)
        assert 2 <= len(top) <= 3


ECHO_PROMPT = "The capital of France is Paris. 巴黎是法国的首都。"


@pytest.fixture(scope="module")
def reference():
    return smollm2_reference()


def test_echo_logprobs_score_the_prompt_as_transformers(server: Server, reference) -> None:
    """lm-evaluation-harness' loglikelihood request: echo, logprobs, max_tokens 0."""
    client = server.client()
    as_ids = client.completions.create(model=SERVED, prompt=ECHO_PROMPT, echo=True, logprobs=2, max_tokens=0,
                                       extra_body={"return_tokens_as_token_ids": True})
    choice = as_ids.choices[0]
    assert choice.text == ECHO_PROMPT and choice.finish_reason == "length"
    assert as_ids.usage.completion_tokens == 0
    ids = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
    assert len(ids) == as_ids.usage.prompt_tokens
    ref = reference_logprobs(reference, ids)
    values, tops = choice.logprobs.token_logprobs, choice.logprobs.top_logprobs
    assert values[0] is None and tops[0] is None
    for i in range(1, len(ids)):
        assert values[i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-3)
        best = ref[i - 1].topk(3)
        if best.values[0] - best.values[2] > 1e-3:  # the reference's best token is in our top 2
            assert f"token_id:{best.indices[0].item()}" in tops[i]
        assert tops[i][f"token_id:{ids[i]}"] == pytest.approx(values[i])
        assert 2 <= len(tops[i]) <= 3

    as_text = client.completions.create(model=SERVED, prompt=ECHO_PROMPT, echo=True, logprobs=2, max_tokens=0)
    logprobs = as_text.choices[0].logprobs
    assert logprobs.token_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx(values[1:], abs=1e-5)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(ids))]


def test_echo_logprobs_with_generation_and_stream(server: Server) -> None:
    client = server.client()
    request = dict(model=SERVED, prompt="Hello, my name is", echo=True, logprobs=1, max_tokens=4, temperature=0)
    whole = client.completions.create(**request)
    prompt_tokens = whole.usage.prompt_tokens
    logprobs = whole.choices[0].logprobs
    assert len(logprobs.tokens) == prompt_tokens + whole.usage.completion_tokens
    assert logprobs.token_logprobs[0] is None and all(v <= 0 for v in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens) == whole.choices[0].text  # SmolLM2 adds no BOS: the tokens spell the text
    assert logprobs.text_offset[prompt_tokens] == len(request["prompt"])
    chunks = [c for c in client.completions.create(**request, stream=True) if c.choices]
    assert chunks[0].choices[0].text.startswith(request["prompt"])
    assert len(chunks[0].choices[0].logprobs.tokens) >= prompt_tokens
    streamed = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-5)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    wait_idle(server)


def test_echo_logprobs_of_two_prompts_and_n(server: Server) -> None:
    response = server.client().completions.create(model=SERVED, prompt=["One two three", "Red green"], echo=True,
                                                  logprobs=0, max_tokens=2, n=2, seed=3)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    for c in response.choices:
        assert c.text.startswith("One two three" if c.index < 2 else "Red green")
        assert c.logprobs.token_logprobs[0] is None
    first, second = response.choices[0].logprobs, response.choices[1].logprobs
    prompt_len = len(first.tokens) - 2
    assert first.token_logprobs[1:prompt_len] == second.token_logprobs[1:prompt_len]  # one scored prompt


def test_prompt_scoring_errors(server: Server) -> None:
    with server.http() as http:
        no_echo = http.post("/v1/completions", json={"model": SERVED, "prompt": "hi", "max_tokens": 0})
        too_many = http.post("/v1/completions", json={"model": SERVED, "prompt": "hi", "echo": True,
                                                        "logprobs": 21, "max_tokens": 0})
    assert "echo" in assert_openai_error(no_echo, 400, "invalid_request_error")
    assert no_echo.json()["error"]["param"] == "max_tokens"
    assert_openai_error(too_many, 400, "invalid_request_error")
    assert too_many.json()["error"]["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        server.client().completions.create(model=SERVED, prompt="hi", max_tokens=0, logprobs=1)


# ---------------------------------------------------------------------- usage, aliases, limits


def test_repeated_long_prompt_reports_cached_tokens(server: Server) -> None:
    client = server.client()
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and politely." for i in range(40))
    messages = [{"role": "system", "content": system}, *QUESTION]
    first = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=1, temperature=0)
    second = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens > 300
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 32  # every full block of the prompt but the last
    assert cached < second.usage.prompt_tokens


def test_alias_is_echoed_and_unknown_model_is_404(server: Server) -> None:
    client = server.client()
    for alias in ALIASES:
        response = client.chat.completions.create(model=alias, messages=QUESTION, max_tokens=1)
        assert response.model == alias
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-5", messages=QUESTION, max_tokens=2)
    assert info.value.code == "model_not_found"
    assert "gpt-5" in info.value.message


def test_max_tokens_beyond_context_is_clamped(server: Server) -> None:
    room = 3
    prompt = [19556] * (MAX_MODEL_LEN - room)  # token ids: the prompt length is exact
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 10 * MAX_MODEL_LEN, "ignore_eos": True}
    with server.http() as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == room
    assert response.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": SERVED, "messages": QUESTION, "temperature": 3.0}, "temperature"),
        ({"model": SERVED, "messages": QUESTION, "max_tokens": -1}, "max_tokens"),
        ({"model": SERVED, "messages": QUESTION, "n": 0}, "n"),
        ({"model": SERVED, "messages": []}, "messages"),
        ({"model": SERVED, "messages": QUESTION, "top_p": 0}, "top_p"),
        ({"model": SERVED, "messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        ({"model": SERVED, "messages": QUESTION, "top_logprobs": 2}, None),
        ({"model": SERVED, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
        ({"model": SERVED, "messages": QUESTION, "tools": [{"type": "function"}]}, "tools.0.function"),
        ({"model": SERVED}, "messages"),
    ],
)
def test_invalid_values_are_400(server: Server, body: dict[str, Any], param: str | None) -> None:
    with server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert_openai_error(response, 400, "invalid_request_error")
    assert response.json()["error"]["param"] == param


def test_invalid_values_through_openai_client(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SERVED, messages=QUESTION, temperature=2.5)
    assert "temperature" in info.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=SERVED, prompt="hi", max_tokens=-5)


def test_sparse_attention_field_reaches_the_engine(server: Server) -> None:
    client = server.client()
    request = dict(model=SERVED, prompt="The three laws of robotics are", max_tokens=6, temperature=0)
    dense = client.completions.create(**request)
    # the block mode's default budget (2,048 tokens) covers this context: the same tokens as dense
    block = client.completions.create(**request, extra_body={"sparse_attention": {"mode": "block"}})
    assert block.choices[0].text == dense.choices[0].text
    chat = client.chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=3, extra_body={
        "sparse_attention": {"mode": "block", "top_k": 64, "sink_tokens": 4, "local_tokens": 16}})
    assert chat.usage.completion_tokens == 3
    # a budget of 64 of 400 tokens changes the numbers, where a server that dropped the field would answer
    # exactly as dense does (both requests find the prompt in the prefix cache, put there by the first one)
    long = dict(model=SERVED, prompt=[19556, 28, 957, 1462, 314] * 80, max_tokens=4, temperature=0, logprobs=1)
    budget = {"mode": "block", "top_k": 64, "sink_tokens": 4, "local_tokens": 16}

    def logprobs(**extra: Any) -> list[float]:
        response = client.completions.create(**long, extra_body={"ignore_eos": True, **extra})
        return response.choices[0].logprobs.token_logprobs

    logprobs()
    assert logprobs(sparse_attention=budget) != logprobs()
    with server.http() as http:
        for sparse, message in [({"mode": "native"}, "no built-in sparse indexer"),
                                ({"mode": "block", "top_k": 8}, "must be at least sink_tokens + local_tokens"),
                                ({"mode": "block", "threshold": 2}, "threshold must be in (0, 1]")]:
            response = http.post("/v1/chat/completions", json={"model": SERVED, "messages": QUESTION,
                                                               "sparse_attention": sparse})
            assert_openai_error(response, 400, "invalid_request_error")
            assert message in response.json()["error"]["message"]
        for sparse, param in [({"mode": "blocky"}, "sparse_attention.mode"),
                              ({"budget": 5}, "sparse_attention.budget")]:
            response = http.post("/v1/completions", json={"model": SERVED, "prompt": "hi", "sparse_attention": sparse})
            assert_openai_error(response, 400, "invalid_request_error")
            assert response.json()["error"]["param"] == param


def test_malformed_json_is_400(server: Server) -> None:
    with server.http() as http:
        response = http.post(
            "/v1/chat/completions",
            content=b'{"model": "smollm2", "messages": [',
            headers={"content-type": "application/json"},
        )
    message = assert_openai_error(response, 400, "invalid_request_error")
    assert "JSON" in message


def test_prompt_too_long_is_400_with_the_limit(server: Server) -> None:
    long_text = "hello " * (MAX_MODEL_LEN + 50)
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": long_text}])
    assert str(MAX_MODEL_LEN) in info.value.message
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=SERVED, prompt=long_text)
    assert str(MAX_MODEL_LEN) in info.value.message


def test_unknown_route_is_openai_style_404(server: Server) -> None:
    with server.http() as http:
        assert_openai_error(http.get("/v1/nothing-here"), 404, "invalid_request_error")


def test_concurrent_streams_batch_then_overload_is_503(server: Server) -> None:
    wait_idle(server)

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:

            async def hold() -> None:
                async with http.stream("POST", "/v1/chat/completions", json={**ENDLESS, "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        pass

            holders = [asyncio.create_task(hold()) for _ in range(CAPACITY)]
            try:
                deadline = time.monotonic() + 60
                # the streams run batched together: max_num_seqs running, the rest waiting
                held = {"requests_in_flight": CAPACITY, "num_running": MAX_NUM_SEQS, "num_waiting": MAX_WAITING}
                while {k: v for k, v in (await http.get("/v1/health")).json()["engine"].items() if k in held} != held:
                    assert time.monotonic() < deadline, "the holding requests were never all admitted and batched"
                    await asyncio.sleep(0.05)
                return await http.post("/v1/chat/completions", json={"model": SERVED, "messages": QUESTION})
            finally:
                for task in holders:
                    task.cancel()
                await asyncio.gather(*holders, return_exceptions=True)

    response = asyncio.run(scenario())
    assert_openai_error(response, 503, "server_error", "overloaded")
    assert response.headers["retry-after"] == "1"
    wait_idle(server)  # the cancelled holders were aborted and gave their blocks back


# ---------------------------------------------------------------------- disconnects and metrics


def test_disconnect_mid_stream_frees_kv_blocks(server: Server) -> None:
    idle = wait_idle(server)
    generated_before = metric(scrape(server), "glmserve_generation_tokens_total")
    with server.http() as http, http.stream("POST", "/v1/chat/completions", json={**ENDLESS, "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(line for line in lines if '"content"' in line)
        busy = engine_state(server)  # still connected: the request holds KV blocks
        assert busy["requests_in_flight"] == 1
        assert busy["num_free_blocks"] < idle["num_free_blocks"]
    # leaving the `with` closes the connection mid-stream
    after = wait_idle(server, timeout_s=15)
    assert after["num_free_blocks"] == idle["num_free_blocks"]
    # aborted, not completed: a completed request would have added its tokens
    assert metric(scrape(server), "glmserve_generation_tokens_total") == generated_before


def test_disconnect_while_waiting_for_non_streaming_response(server: Server) -> None:
    wait_idle(server)
    before = metric(scrape(server), "glmserve_http_requests_total", endpoint="/v1/chat/completions", status="499")

    async def leave_while_generating() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            waiting = asyncio.create_task(http.post("/v1/chat/completions", json=ENDLESS))
            try:
                deadline = time.monotonic() + 60
                while (await http.get("/v1/health")).json()["engine"]["num_running"] != 1:
                    assert not waiting.done() and time.monotonic() < deadline, "the request never ran"
                    await asyncio.sleep(0.05)
            finally:  # the client goes away while its (1,024-step) generation runs
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)
            assert waiting.cancelled(), "the response came before the client left"

    asyncio.run(leave_while_generating())
    wait_idle(server, timeout_s=15)
    after = metric(scrape(server), "glmserve_http_requests_total", endpoint="/v1/chat/completions", status="499")
    assert after == before + 1


def test_metrics_move_as_requests_complete(server: Server) -> None:
    wait_idle(server)

    def ask() -> Any:
        return server.client().chat.completions.create(
            model=SERVED, messages=QUESTION, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
        )

    ask()  # the same prompt again below hits the prefix cache
    before = scrape(server)
    response = ask()
    after = scrape(server)

    def delta(sample: str, **labels: str) -> float:
        return metric(after, sample, **labels) - metric(before, sample, **labels)

    assert delta("glmserve_http_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert delta("glmserve_request_finished_total", finish_reason="length") == 1
    assert delta("glmserve_generation_tokens_total") == 3
    assert delta("glmserve_prompt_tokens_total") == response.usage.prompt_tokens
    assert response.usage.prompt_tokens_details.cached_tokens > 0
    assert delta("glmserve_cached_prompt_tokens_total") == response.usage.prompt_tokens_details.cached_tokens
    assert delta("glmserve_time_to_first_token_seconds_count") == 1
    assert delta("glmserve_e2e_request_latency_seconds_count") == 1
    assert delta("glmserve_request_queue_time_seconds_count") == 1
    assert 0 <= delta("glmserve_request_queue_time_seconds_sum") <= delta("glmserve_e2e_request_latency_seconds_sum")
    assert delta("glmserve_inter_token_latency_seconds_count") >= 1
    finished = {
        s.labels["finish_reason"]: s.value
        for f in text_string_to_metric_families(after)
        for s in f.samples
        if s.name == "glmserve_request_finished_total"
    }
    assert metric(after, "glmserve_truncation_rate") == pytest.approx(finished["length"] / sum(finished.values()))
    assert 0 < metric(after, "glmserve_prefix_cache_hit_rate") <= 1
    assert metric(after, "glmserve_kv_cache_usage") == 0  # idle again
    assert metric(after, "glmserve_num_requests_running") == 0
    assert metric(after, "glmserve_num_requests_waiting") == 0


def test_alias_to_another_model_is_refused_at_startup() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "glmserve.cli", "serve", "--served-model-name", SERVED, "--alias", "gpt-4o=llama-70b"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "gpt-4o=llama-70b" in result.stderr
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------------- context compression


def test_compress_endpoint_trace_map(server: Server) -> None:
    """POST /v1/compress: the contract's fields, spans verbatim from their documents, typed 400s."""
    policy = "\n\n".join(
        [f"{i}. Rule {i}\n\nThe maintainer must keep rule {i} in mind. It was adopted after long talks. "
         f"Many people were there and the coffee was good. Packages must not break rule {i}." for i in range(1, 9)])
    notes = "Minutes of the meeting. Everyone agreed. The venue was in Leeds on 2024-05-01."
    body = {"documents": [{"id": "policy", "text": policy}, {"id": "notes", "text": notes}],
            "query": "Where was the venue?", "target_ratio": 2}
    with server.http() as http:
        reply = http.post("/v1/compress", json=body)
        assert reply.status_code == 200, reply.text
        out = reply.json()
        assert out["original_tokens"] > out["compressed_tokens"] > 0
        texts = {"policy": policy, "notes": notes}
        assert {s["doc"] for s in out["spans"]} == {"policy", "notes"}
        for span in out["spans"]:
            assert texts[span["doc"]][span["start"]:span["end"]] in out["text"]
            assert span["kind"] in ("anchor", "narrative") and span["paragraph"] >= 1
        assert "The venue was in Leeds on 2024-05-01." in out["text"]
        assert all(f"{i}. Rule {i}" in out["text"] for i in range(1, 9))  # headings are anchors
        bad = http.post("/v1/compress", json={**body, "target_ratio": 0.5})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        assert http.post("/v1/compress", json={"documents": []}).status_code == 400


def test_chat_context_compression_returns_the_trace_map(server: Server) -> None:
    """The chat option compresses the documents before prefill and answers with the trace map beside it."""
    text = "\n\n".join(f"{i}. Part {i}\n\nThe weather was mild and people talked for hours on day {i}. "
                       f"Nothing much happened in the afternoon of day {i}." for i in range(1, 7))
    text += "\n\n7. Office\n\nThe registered office is in Leeds."
    body = {"model": SERVED, "messages": [{"role": "user", "content": "Where is the registered office?"}],
            "max_tokens": 4, "temperature": 0,
            "context_compression": {"documents": [{"id": "memo", "text": text}], "target_ratio": 2}}
    with server.http() as http:
        reply = http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        out = reply.json()
        trace = out["context_compression"]
        assert "text" not in trace and trace["original_tokens"] > trace["compressed_tokens"]
        assert out["usage"]["prompt_tokens"] > trace["compressed_tokens"]
        kept = [text[s["start"]:s["end"]] for s in trace["spans"]]
        assert "The registered office is in Leeds." in kept and "7. Office" in kept
        assert out["choices"][0]["message"]["content"] is not None
    # streamed through the official client: the trace map comes in one extra chunk with no choices, after the
    # finish chunk and before the usage chunk
    request = {k: v for k, v in body.items() if k != "context_compression"}
    chunks = list(server.client().chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True},
        extra_body={"context_compression": body["context_compression"]}))
    [at] = [i for i, c in enumerate(chunks) if getattr(c, "context_compression", None) is not None]
    assert chunks[at].choices == [] and chunks[at].context_compression == trace
    assert [c.choices[0].finish_reason for c in chunks[:at] if c.choices][-1] in ("stop", "length")
    assert at == len(chunks) - 2 and chunks[-1].usage.prompt_tokens == out["usage"]["prompt_tokens"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        out["choices"][0]["message"]["content"]


# ---------------------------------------------------------------------- shutdown (keep last)


def test_sigterm_finishes_in_flight_request_and_exits_zero(server: Server) -> None:
    max_tokens = 16
    body = {"model": SERVED, "messages": QUESTION, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        server.proc.send_signal(signal.SIGTERM)

        def refused() -> bool:  # the listening socket closes at once
            try:
                httpx.get(f"{server.base_url}/health", timeout=5)
            except httpx.ConnectError:
                return True
            # Connected just as the socket closed: dropped unanswered (RemoteProtocolError, ~1 run in 10) or reset
            # (ReadError "Connection reset by peer", seen in CI 2026-12-06).
            except (httpx.RemoteProtocolError, httpx.ReadError):
                return True
            return False

        wait_for(refused, 10, "the server to stop accepting connections", server.log)
        rest = [line for line in lines if line]  # ... while the in-flight stream runs to its end
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: ") :])["usage"]["completion_tokens"] == max_tokens
    assert any('"finish_reason":"length"' in line for line in rest)
    assert server.proc.wait(timeout=60) == 0
    assert "Traceback" not in server.log()
