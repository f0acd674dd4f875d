"""The serving feedback loop end to end (issue 16's check "zero planted canaries from served logs in the
training output"): a real `glmserve serve --log-interactions DIR` on a tiny model, driven by the official
`openai` client (chat whole and streamed, text completions, a regeneration, thumbs up and down through
POST /v1/feedback), then `glmserve data feedback` over what it logged. No planted PII may reach any output
file, no canary the rules must drop may reach the training output, and every record leads back to its line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_process import STARTUP_TIMEOUT_S, ServerProcess, glmserve_process, wait_for
from test_data_feedback import PII
from tiny_models import make_tiny_chat_model

from glmserve.cli import main
from glmserve.data.records import write_records

pytestmark = pytest.mark.slow
STOP = ["e", "o"]  # the tiny random model's greedy answers reach one of these within a few tokens: "stop"
CANARY_LOW = "CANARY-LOWCONF-5e1d"
CANARY_DOWN = "CANARY-THUMBSDOWN-a27c"
CANARY_TRAIN = "CANARY-TRAINDUP-93f0"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("feedback")
    model = make_tiny_chat_model("llama", root / "model")
    args = ["--model", str(model), "--served-model-name", "tiny", "--max-model-len", "256", "--num-threads", "1",
            "--kv-cache-memory-bytes", str(4 << 20), "--shutdown-timeout", "5",
            "--log-interactions", str(root / "logs")]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("GLMSERVE_TORCH_ONLY", "1")  # the HTTP layer and the log are under test, not the kernels
        with glmserve_process(args, root / "server.log") as process:
            env.undo()
            wait_for(lambda: httpx.get(f"{process.base_url}/v1/health").status_code == 200, STARTUP_TIMEOUT_S,
                     "readiness", process.log)
            yield process


def _logged(logs: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(logs.glob("*.jsonl")) for line in f.read_text().splitlines()]


def _rate(client: openai.OpenAI, response_id: str, rating: int) -> httpx.Response:
    return client.post("/feedback", body={"id": response_id, "rating": rating}, cast_to=httpx.Response)


@pytest.fixture
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c  # closed: no keep-alive connection holds up the server's shutdown


def test_no_planted_canary_reaches_the_training_output(server: ServerProcess, client: openai.OpenAI,
                                                       tmp_path: Path) -> None:
    system = {"role": "system", "content": f"Support desk; escalate to {PII['email']}."}

    def chat(text: str, **kwargs):
        return client.chat.completions.create(model="tiny", messages=[system, {"role": "user", "content": text}],
                                              temperature=0, **{"stop": STOP, "max_tokens": 12, **kwargs})

    personal = chat(f"身份证号 {PII['resident_id']}，卡号 {PII['card']}，手机 {PII['mobile']}。",
                    metadata={"customer": PII["email"]})
    assert personal.choices[0].finish_reason == "stop"
    liked = chat(f"Refund to card {PII['visa']} please.")
    _rate(client, liked.id, 1)
    low = chat(f"Explain {CANARY_LOW}.", stop=None, max_tokens=2)
    assert low.choices[0].finish_reason == "length"
    disliked = chat(f"What is {CANARY_DOWN}?")
    _rate(client, disliked.id, -1)
    dup = chat(f"Repeat {CANARY_TRAIN} now.")
    first, again = chat("Tell me a story."), chat("Tell me a story.")  # a regeneration
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(f"Call {PII['mobile']} back.", stream=True)
                       if c.choices)
    text = client.completions.create(model="tiny", prompt=f"Customer {PII['email']} wrote:", max_tokens=8,
                                     temperature=0, stop=STOP)
    with pytest.raises(openai.NotFoundError):
        _rate(client, "chatcmpl-never-answered", 1)
    logs = Path(server.log_path).parent / "logs"
    expected = 9 + 2  # interactions and feedback lines
    lines = wait_for(lambda: len(found := _logged(logs)) >= expected and found, 30, "the log lines", server.log)
    by_id = {r["id"]: r for r in lines if r["type"] == "interaction"}
    assert by_id[again.id]["regeneration"] == 1 and by_id[first.id]["regeneration"] == 0
    assert by_id[text.id]["endpoint"] == "completions" and by_id[personal.id]["metadata"] == {"customer": PII["email"]}
    assert streamed and any(r["choices"][0]["text"] == streamed for r in by_id.values())
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in logs.glob("*.jsonl"))
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert "glmserve_interaction_log_records_total 11.0" in metrics

    # the training set already holds the canary conversation
    logged = by_id[dup.id]
    convo = [*logged["messages"], {"role": "assistant", "content": logged["choices"][0]["text"]}]
    train = tmp_path / "train.jsonl"
    write_records(train, [{"id": "dup", "messages": convo},
                          *({"id": f"t{i}", "text": f"Training document {i} on topic {i * 3}."} for i in range(60))])
    out = tmp_path / "out"
    main(["data", "feedback", str(logs), "--out", str(out), "--train-set", str(train)])

    kept = [json.loads(x) for x in (out / "kept.jsonl").read_text().splitlines()]
    rejected = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
    report = json.loads((out / "report.json").read_text())
    everything = "".join((out / n).read_text() for n in ("kept.jsonl", "rejected.jsonl", "report.json"))
    for value in PII.values():
        assert value not in everything and value.replace(" ", "") not in everything
    kept_text = (out / "kept.jsonl").read_text()
    for canary in (CANARY_LOW, CANARY_DOWN, CANARY_TRAIN):
        assert canary not in kept_text
    reasons = {r["provenance"]["response_id"]: r["reason"] for r in rejected}
    assert reasons[low.id] == "low_confidence" and reasons[disliked.id] == "negative_feedback"
    assert reasons[dup.id] == "duplicate_of_train" and reasons[first.id] == "low_confidence"
    kept_ids = {r["provenance"]["response_id"] for r in kept}
    assert {personal.id, liked.id} <= kept_ids
    assert next(r for r in kept if r["provenance"]["response_id"] == liked.id)["tier"] == "high"
    # provenance is complete: every logged choice is in one output, and each record leads back to its line
    assert len(kept) + len(rejected) == report["candidates"] == 9
    for r in kept + rejected:
        p = r["provenance"]
        line = json.loads((logs / p["file"]).read_text().splitlines()[p["line"] - 1])
        assert line["id"] == p["response_id"] and p["time"] and p["model"] == "tiny"
    assert report["feedback_lines"] == 2 and report["malformed_lines"] == 0
