"""examples/drafting_assistant.py against a real `glmserve serve` (a tiny random-weight Llama with a chat
template) through the official openai client: three turns in one session, turn 2 and 3 load the session's KV
(cached tokens), and the draft checks' findings, cited by section and paragraph, go into the next turn.
Slow (a server process: 35 s at load 16 on the 2 shared cores), so outside the default run."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from example_modules import load_example
from server_process import STARTUP_TIMEOUT_S, glmserve_process, wait_for
from tiny_models import make_tiny_chat_model

START = ("1. Definitions\n\nThe Supplier delivers the goods.\n\n\"Supplier\" means Acme Ltd.\n\n"
         "2. Dates\n\nDelivery is on 2025-04-10, before the inspection on 2025-04-01.")


@pytest.mark.slow
def test_drafting_assistant_reuses_session_kv(tmp_path: Path, capsys) -> None:
    model = make_tiny_chat_model("llama", tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 2048  # random weights: room for three turns of a short draft
    (model / "config.json").write_text(json.dumps(config))
    (tmp_path / "brief.txt").write_text("Write section 3, Payment.\nWrite section 4, Term.\nWrite section 5, Law.\n")
    (tmp_path / "start.txt").write_text(START)
    (tmp_path / "glossary.txt").write_text("Supplier\nemail = e-mail\n")
    args = ["--model", str(model), "--max-model-len", "2048", "--kv-cache-memory-bytes", str(8 << 20),
            "--num-threads", "1", "--session-store", str(tmp_path / "sessions")]
    with glmserve_process(args, tmp_path / "server.log") as server:
        wait_for(lambda: httpx.get(f"{server.base_url}/v1/health", timeout=30).status_code == 200,
                 STARTUP_TIMEOUT_S, "readiness", server.log)
        turns = load_example("drafting_assistant").main([
            "--base-url", f"{server.base_url}/v1", "--brief", str(tmp_path / "brief.txt"), "--draft",
            str(tmp_path / "start.txt"), "--glossary", str(tmp_path / "glossary.txt"), "--session-id", "doc-1",
            "--max-tokens", "8", "--out", str(tmp_path / "draft.txt"), "--json"])
        info = httpx.get(f"{server.base_url}/v1/sessions/doc-1", timeout=30).json()
    assert [t.turn for t in turns] == [1, 2, 3] and info["turns"] == 3
    assert turns[0].cached_tokens == 0
    for before, t in zip(turns, turns[1:]):  # the earlier turns' KV is loaded, not recomputed
        assert t.prompt_tokens > before.prompt_tokens and t.cached_tokens >= 16
    printed = json.loads(capsys.readouterr().out)
    assert [p["cached_tokens"] for p in printed] == [t.cached_tokens for t in turns]
    draft = (tmp_path / "draft.txt").read_text()
    assert draft.startswith(START)
    found = {(f["check"], f["at"]["section"]): f for f in turns[0].findings}
    order = found[("time_order", "2")]
    assert draft[order["at"]["start"]:order["at"]["end"]] == order["quote"]
    assert ("defined_before_use", "1") in found


