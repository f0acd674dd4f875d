"""`glmserve data feedback` on logs written by the server's own record builder and writer
(glmserve/server/interactions.py over engine outputs): tiers and reasons, PII scrubbed, dedup against the
training set, the self-share cap, provenance that leads back to the log line. The same check through a real
server and the `openai` client is tests/test_feedback_loop.py (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glmserve.cli import main
from glmserve.data.feedback import feedback, grade, tier_of
from glmserve.data.records import write_records
from glmserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from glmserve.errors import InvalidRequestError
from glmserve.server.interaction_log import InteractionLog
from glmserve.server.interactions import FeedbackRequest, InteractionNotFoundError, Interactions
from glmserve.server.protocol import ChatMessage

# planted PII (checksums valid: the resident ID's GB 11643 digit, the cards' Luhn digit) and canaries
PII = {"email": "zhang.wei.canary@mailbox.cn", "resident_id": "11010519491231002X",
       "card": "6222 0212 3456 7894", "mobile": "13812345678", "visa": "4539148803436467"}
CANARY_LOW = "CANARY-LOWCONF-7f3a"
CANARY_DOWN = "CANARY-THUMBSDOWN-91be"
CANARY_TRAIN = "CANARY-TRAINDUP-c0de"
LONG = ("The scheduler admits decode requests first and then fills the remaining token budget with chunked "
        "prefills, preempting the newest request when the pool of key value blocks runs out of free blocks.")


def _output(rid: str, texts: list[tuple[str, str]], logprob: float | None = None) -> RequestOutput:
    outs = [CompletionOutput(i, text, list(range(max(1, len(text.split())))),
                             None if logprob is None else [TokenLogprob(0, logprob)], reason)
            for i, (text, reason) in enumerate(texts)]
    return RequestOutput(rid, [1, 2, 3], 0, outs, finished=True)


def _user(text: str) -> list[ChatMessage]:
    return [ChatMessage(role="system", content=f"Support desk. Escalations: {PII['email']}"),
            ChatMessage(role="user", content=text)]


def _write_logs(directory: Path) -> Interactions:
    inter = Interactions(InteractionLog(directory))

    def chat(rid: str, text: str, answer: str, reason: str = "stop", logprob: float | None = None) -> None:
        inter.chat(rid, "tiny", _user(text), _output(rid, [(answer, reason)], logprob), {"user_tag": PII["email"]})

    chat("ok", f"My ID card 身份证号 {PII['resident_id']}, card {PII['card']}, phone {PII['mobile']}.",
         f"Thanks, I wrote to {PII['email']} about card {PII['visa']}.")
    chat("up", "How do I reset my password?", "Open settings, choose security, then reset.")
    chat("low", f"Tell me about {CANARY_LOW}.", "It is a", reason="length")
    chat("down", f"What is {CANARY_DOWN}?", "A wrong answer that the user rejected.")
    for i in range(3):  # asked three times: the first two answers were regenerated
        chat(f"regen{i}", "Write a haiku about caches.", f"Blocks fall like leaves, version {i}.")
    chat("train", f"Quote {CANARY_TRAIN} please.", "It is in the training set already.")
    chat("near", "Explain the scheduler.", LONG)
    chat("unsure", "Is this answer certain?", "Perhaps, perhaps not.", logprob=-5.0)
    chat("empty", "Say nothing.", "   ")
    inter.chat("tool", "tiny", [ChatMessage(role="user", content="Weather?"),
                                ChatMessage(role="assistant", tool_calls=[{"id": "c1", "function": {
                                    "name": "weather", "arguments": json.dumps({"email": PII["email"]})}}]),
                                ChatMessage(role="tool", content="sunny", tool_call_id="c1")],
               _output("tool", [("Sunny today.", "stop")]), None)
    inter.completion("cmpl", "tiny", [f"Dear customer {PII['mobile']}, your order", [5, 6, 7]],
                     [_output("cmpl-0", [(" has shipped.", "stop")]), _output("cmpl-1", [(" ok.", "stop")])], None)
    inter.feedback(FeedbackRequest(id="up", rating=1))
    inter.feedback(FeedbackRequest(id="down", rating=1, comment=f"call me at {PII['mobile']}"))
    inter.feedback(FeedbackRequest(id="down", rating=-1))  # the last rating counts
    with pytest.raises(InteractionNotFoundError):
        inter.feedback(FeedbackRequest(id="never-answered", rating=1))
    inter.log.close()
    with open(next(directory.glob("*.jsonl")), "a") as f:
        f.write('{"type": "interaction", "id": "cut-by-a-cra')  # a crash's half line
    return inter


def _train_set(path: Path, logs: Path) -> None:
    line = next(json.loads(x) for f in logs.glob("*.jsonl") for x in f.read_text().splitlines()
                if CANARY_TRAIN in x and x.endswith("}"))
    convo = [*line["messages"], {"role": "assistant", "content": line["choices"][0]["text"]}]
    filler = [{"id": f"t{i}", "text": f"Training document number {i} about topic {i * 7} and more words."}
              for i in range(40)]
    near = {"id": "near", "messages": [{"role": "user", "content": "Explain the scheduler to me."},
                                       {"role": "assistant", "content": LONG}]}
    write_records(path, [*filler, {"id": "exact", "messages": convo}, near])


def _outputs(out: Path) -> tuple[list[dict], list[dict], str]:
    kept = [json.loads(x) for x in (out / "kept.jsonl").read_text().splitlines()]
    rejected = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
    everything = "".join((out / name).read_text() for name in ("kept.jsonl", "rejected.jsonl", "report.json"))
    return kept, rejected, everything


def test_grading_rule() -> None:
    assert tier_of(grade("stop", None, 0, None)) == "medium"
    assert tier_of(grade("stop", 1, 0, None)) == "high"
    assert tier_of(grade("length", 1, 0, None)) == "low"
    assert tier_of(grade("stop", None, 1, None)) == "low"
    assert grade("stop", None, 0, 0.0) == pytest.approx(0.8) and grade("stop", None, 5, None) == 0.3


def test_feedback_grades_scrubs_dedups_and_caps(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    logs, out = tmp_path / "logs", tmp_path / "out"
    _write_logs(logs)
    _train_set(tmp_path / "train.jsonl", logs)
    # 0.08 of 42 training records + the kept ones: 3 may come from the logs (the best; ties by time)
    main(["data", "feedback", str(logs), "--out", str(out), "--train-set", str(tmp_path / "train.jsonl"),
          "--max-self-share", "0.08"])
    assert json.loads(capsys.readouterr().out)["kept"] == 3
    kept, rejected, everything = _outputs(out)
    report = json.loads((out / "report.json").read_text())
    reasons = {r["id"]: r["reason"] for r in rejected}
    assert reasons == {"fb-low-c0": "low_confidence", "fb-down-c0": "negative_feedback",
                       "fb-regen0-c0": "low_confidence", "fb-regen1-c0": "low_confidence",
                       "fb-train-c0": "duplicate_of_train", "fb-near-c0": "near_duplicate_of_train",
                       "fb-unsure-c0": "low_confidence", "fb-empty-c0": "empty_answer", "fb-tool-c0": "tool_calls",
                       "fb-cmpl-p1-c0": "token_id_prompt", "fb-cmpl-p0-c0": "self_share_cap"}
    assert [r["id"] for r in kept] == ["fb-up-c0", "fb-ok-c0", "fb-regen2-c0"]
    by_id = {r["id"]: r for r in kept}
    assert by_id["fb-up-c0"]["tier"] == "high" and by_id["fb-ok-c0"]["tier"] == "medium"
    assert by_id["fb-regen2-c0"]["signals"]["regeneration"] == 2
    ok = by_id["fb-ok-c0"]["messages"]
    assert [m["role"] for m in ok] == ["system", "user", "assistant"]
    assert "00000000000000000X" in ok[1]["content"] and "0000 0000 0000 0000" in ok[1]["content"]
    assert "user1@example.com" in ok[2]["content"]
    # nothing planted survives anywhere, in any shape; the canaries the rules drop are not in the training output
    for value in PII.values():
        assert value not in everything and value.replace(" ", "") not in everything
    assert "user_tag" not in everything and "call me" not in everything
    kept_text = (out / "kept.jsonl").read_text()
    for canary in (CANARY_LOW, CANARY_DOWN, CANARY_TRAIN):
        assert canary not in kept_text
    # provenance: every candidate accounted for once, and each leads back to its log line
    assert len(kept) + len(rejected) == report["candidates"] == 14
    assert len({r["id"] for r in kept + rejected}) == 14
    for r in kept + rejected:
        p = r["provenance"]
        line = json.loads((logs / p["file"]).read_text().splitlines()[p["line"] - 1])
        assert line["id"] == p["response_id"] and line["type"] == "interaction"
    assert by_id["fb-up-c0"]["provenance"]["feedback"][0]["file"].startswith("interactions-")
    assert report["malformed_lines"] == 1 and report["feedback_lines"] == 3
    assert sum(report["tiers"].values()) == 14 and report["self_share"]["applied"] is True


def test_bad_arguments_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="does not exist"):
        feedback(tmp_path / "missing", tmp_path / "out")
    with pytest.raises(InvalidRequestError, match="max_self_share"):
        feedback(tmp_path, tmp_path / "out", max_self_share=0)
