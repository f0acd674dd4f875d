"""The ledger equals the usage the clients saw, through `glmserve gateway` (the proxy with keys and a real SQLite
ledger file) in front of two fake backends (tests/fake_backend.py): non-streamed and streamed answers, streams the
client abandons mid-way (the backend holds the stream until the client is gone, so the usage never reached it),
and streams a backend cuts (an SSE error event, never `[DONE]`). The short form of the fault bench's ledger check
(bench/gateway_fault.py); the official `openai` client checks that a streamed answer's usage is billed."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
from pathlib import Path

import httpx
import openai
from server_process import listening_process, wait_for

FAKE_BACKEND = Path(__file__).with_name("fake_backend.py")
KEY = "sk-ledger-0123456789"


async def _one(http: httpx.AsyncClient, i: int) -> tuple[str, str | None, dict | None]:
    """(how it ended, response id, the usage the client received)."""
    messages = [{"role": "user", "content": f"request {i}"}]
    if i % 3 == 0:
        doc = (await http.post("/v1/chat/completions", json={"model": "m", "messages": messages})).json()
        return "ok", doc["id"], doc["usage"]
    abandon = i % 3 == 1 and i % 2 == 0
    body = {"model": "m", "messages": messages, "stream": True, "stream_options": {"include_usage": True},
            **({"hold_after": 2} if abandon else {})}
    rid, usage, last, content = None, None, None, 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            last = line[6:]
            if last == "[DONE]":
                break
            doc = json.loads(last)
            rid = doc.get("id", rid)
            usage = doc.get("usage") or usage
            content += bool(doc.get("choices") and doc["choices"][0]["delta"].get("content"))
            if abandon and content == 2:
                return "abandoned", rid, None  # leaving the block closes the connection
    return ("done" if last == "[DONE]" else json.loads(last)["error"]["code"]), rid, usage


def test_ledger_equals_the_usage_clients_saw_through_the_proxy(tmp_path: Path) -> None:
    keys, ledger = tmp_path / "keys.toml", tmp_path / "ledger.sqlite3"
    keys.write_text(f'[[key]]\nname = "team"\nkey = "{KEY}"\n')
    with listening_process([sys.executable, str(FAKE_BACKEND), "--name", "a"], tmp_path / "a.log") as a, \
            listening_process([sys.executable, str(FAKE_BACKEND), "--name", "b"], tmp_path / "b.log") as b:
        httpx.post(f"{a.base_url}/control", json={"chunks": 5})
        httpx.post(f"{b.base_url}/control", json={"chunks": 5, "cut_after": 3})  # b's streams are cut mid-way
        argv = [sys.executable, "-m", "glmserve.cli", "gateway", "--port", "0", "--probe-interval", "0.2",
                "--backend", a.base_url, "--backend", b.base_url, "--keys", str(keys),
                "--ledger", f"sqlite:///{ledger}"]
        with listening_process(argv, tmp_path / "gateway.log") as gw:
            wait_for(lambda: httpx.get(f"{gw.base_url}/v1/health").status_code == 200, 30, "readiness", gw.log)

            async def run() -> list[tuple[str, str | None, dict | None]]:
                headers = {"Authorization": f"Bearer {KEY}"}
                async with httpx.AsyncClient(base_url=gw.base_url, headers=headers, timeout=60) as http:
                    return await asyncio.gather(*(_one(http, i) for i in range(36)))

            results = asyncio.run(run())
            client = openai.OpenAI(base_url=f"{gw.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
            official = None
            for _ in range(16):  # until one lands on backend a: a short prompt goes to the least loaded backend,
                # at random among equals, and b (its breaker half-open again) cuts its streams, which the client
                # raises as an APIError (the gateway's SSE error event; nothing billed, as for the cuts above)
                try:
                    chunks = list(client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "x"}], stream=True,
                        stream_options={"include_usage": True}))
                except openai.APIError as cut:
                    assert "lost mid-stream" in str(cut)
                    continue
                official = chunks[-1]
                break
            assert official is not None and official.usage is not None
            results.append(("done", official.id, official.usage.model_dump()))
    ends = [end for end, _, _ in results]
    assert {"ok", "done", "abandoned", "upstream_stream_cut"} <= set(ends), ends
    seen = {rid: usage for _, rid, usage in results if usage is not None}
    unseen = {rid for _, rid, usage in results if usage is None}
    with sqlite3.connect(ledger) as conn:
        rows = {r[0]: r[1:] for r in conn.execute(
            "SELECT request_id, key_name, prompt_tokens, cached_tokens, completion_tokens FROM ledger")}
    assert set(rows) == set(seen) and not unseen & set(rows)  # a row for each usage seen, none for the others
    for rid, usage in seen.items():
        assert rows[rid] == ("team", usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                             usage["completion_tokens"])
    assert sum(r[3] for r in rows.values()) == sum(u["completion_tokens"] for u in seen.values())
