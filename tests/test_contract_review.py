"""Contract review on the model (issue 17): the synthetic contract's gold is consistent with its text and with the
example's rule patterns, quotes are located in kept spans at exact offsets, and (slow) examples/contract_review.py
`--server` against a real `glmserve serve` on the embedded SmolLM2 with block-sparse decode and a KV pool smaller
than the compressed prompt: every request carried context_compression and sparse_attention, KV chunks were
offloaded and sparse decode skipped some of them, and every finding cites the source at exact offsets."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from example_modules import load_example
from server_process import STARTUP_TIMEOUT_S, glmserve_process, wait_for

from glmserve.compress import Span
from glmserve.compress.locate import Locator, locate_quote
from glmserve.compress.synthetic_contract import OPTIONAL_RULES, RULE_NAMES, generate
from glmserve.errors import InvalidRequestError

review = load_example("contract_review")
RULES = {r.name: r for r in review.RULES}


@pytest.mark.parametrize("seed", range(4))
def test_synthetic_contract_gold_is_consistent(seed: int) -> None:
    contract = generate(seed, target_tokens=4000)
    text = contract.text
    assert sorted(RULES) == sorted(RULE_NAMES)
    loc = Locator("contract", text)
    for fact in contract.facts:
        sentence = text[fact.start:fact.end]
        assert sentence.endswith(".") and "\n" not in sentence
        unit = loc.units[loc.unit_index(fact.start)]
        assert (unit.start, unit.end) == (fact.start, fact.end)  # the planted sentence is one unit of the segmenter
        assert (unit.section, unit.paragraph, unit.page) == (fact.section, fact.paragraph, fact.page)
        assert fact.section.count(".") == 1  # a clause label such as "7.3"
        assert review.check(RULES[fact.rule], sentence, contract.rate_cap) is not None
    for name, rule in RULES.items():
        facts = [f for f in contract.facts if f.rule == name]
        matches = [m.span() for m in rule.pattern.finditer(text)]
        # the filler never states a rule: a match of a rule's pattern starts in one of its planted facts or in a
        # heading ("ARTICLE 9 LIMITATION OF LIABILITY"), and every fact is matched
        for a, _ in matches:
            assert any(f.start <= a < f.end for f in facts) or loc.units[loc.unit_index(a)].heading, name
        assert all(any(a < f.end and b > f.start for a, b in matches) for f in facts), name
        gold = contract.gold(name)
        if name == "rate_cap":
            rates = [review.annual_rate(rule.pattern.search(text[f.start:f.end])) for f in facts]
            assert rates == [f.annual_rate for f in facts]
            high = [f for f in facts if f.annual_rate > contract.rate_cap]
            assert gold.status == ("violation" if high else "ok") and list(gold.facts) == (high or facts)
        elif name in contract.omitted:
            assert name in OPTIONAL_RULES and gold.status == "missing" and not facts
        else:
            assert gold.status == "ok" and len(facts) == 1 and gold.facts == tuple(facts)
    assert loc.units[-1].page > 1


def test_synthetic_contract_length_seeded_and_varied() -> None:
    from glmserve.compress.tokens import default_counter

    a = generate(3, 12_000)
    assert generate(3, 12_000).text == a.text
    assert 10_000 <= int(default_counter()([a.text])[0]) <= 14_000
    seeds = [generate(s, 3000) for s in range(12)]
    assert {c.gold("rate_cap").status for c in seeds} == {"ok", "violation"}
    assert any(c.omitted for c in seeds) and any(not c.omitted for c in seeds)
    with pytest.raises(InvalidRequestError, match="target_tokens"):
        generate(0, 100)
    with pytest.raises(InvalidRequestError, match="unknown rule"):
        a.gold("arbitration")


TEXT = "1.1 Fees\n\nThe fee is due monthly. Late payments bear interest at 3% per month. Nothing else applies."


def spans_of(*pieces: str) -> list[Span]:
    out = []
    for p in pieces:
        at = TEXT.index(p)
        out.append(Span("c", at, at + len(p), "1.1", 1, 1, "narrative"))
    return out


def test_locate_quote_exact_across_spans_and_near_miss() -> None:
    spans = spans_of("The fee is due monthly.", "Late payments bear interest at 3% per month.")
    hit = locate_quote(TEXT, spans, "  bear interest at 3% per month ")
    assert hit is not None and hit.exact and TEXT[hit.start:hit.end] == "bear interest at 3% per month"
    both = locate_quote(TEXT, spans, "due monthly. Late payments")  # two adjacent kept sentences
    assert both is not None and both.exact and TEXT[both.start:both.end] == "due monthly. Late payments"
    near = locate_quote(TEXT, spans, "Late payment bears interest at 3% per month")  # a small slip: not exact
    assert near is not None and not near.exact and (near.start, near.end) == (spans[1].start, spans[1].end)
    assert locate_quote(TEXT, spans, "Nothing else applies.") is None  # in the source but not kept
    assert locate_quote(TEXT, spans, "NONE of this") is None and locate_quote(TEXT, [], "fee") is None


def test_model_answer_verdicts() -> None:
    assert review._answer_text('Answer: "Late payments bear interest at 3% per month."\nMore') == \
        "Late payments bear interest at 3% per month."
    assert review.check(RULES["rate_cap"], "interest at 3% per month", 24) == \
        ("violation", "36% a year against a cap of 24%")
    assert review.check(RULES["rate_cap"], "interest at 8% per annum", 24)[0] == "ok"
    assert review.check(RULES["guarantee"], "The fee is due monthly.", 24) is None


@pytest.mark.slow
def test_model_path_against_a_real_server(tmp_path: Path) -> None:
    contract = generate(4, target_tokens=3000)
    # a pool of 768 tokens (SmolLM2: 46,080 bytes a token in float32; offload needs two chunks and one step) under
    # a ~1,250-token prompt (the contract compressed to 1,100 tokens)
    args = ["--sparse-attention", "block", "--sparse-top-k", "128", "--sparse-local-tokens", "64",
            "--kv-cache-memory-bytes", str(768 * 46_080), "--kv-chunk-tokens", "128",
            "--kv-disk-dir", str(tmp_path / "kv"), "--max-num-batched-tokens", "256", "--num-threads", "1"]
    bodies: list[dict] = []

    def record(request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            bodies.append(json.loads(request.content))

    with glmserve_process(args, tmp_path / "server.log") as server:
        wait_for(lambda: httpx.get(f"{server.base_url}/v1/health", timeout=30).status_code == 200,
                 STARTUP_TIMEOUT_S, "readiness", server.log)
        from openai import OpenAI

        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                        http_client=httpx.Client(event_hooks={"request": [record]}, timeout=600))
        findings = review.review_with_model(client, client.models.list().data[0].id,
                                            [review.Document("contract.txt", contract.text)], 24.0,
                                            target_tokens=1100, sparse={"mode": "block", "top_k": 128})
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    assert [b["context_compression"]["query"] for b in bodies] == [r.query for r in review.RULES]
    assert all(b["context_compression"]["documents"][0]["text"] == contract.text for b in bodies)
    assert all(b["sparse_attention"] == {"mode": "block", "top_k": 128} for b in bodies)

    def counter(name: str) -> float:
        return float(next(line.split()[-1] for line in metrics.splitlines() if line.startswith(name)))

    assert counter("glmserve_kv_stream_offloaded_chunks_total") > 0  # the prompt outgrew the pool
    assert counter("glmserve_kv_stream_skipped_slices_total") > 0  # block-sparse decode left chunks unread
    loc = Locator("contract.txt", contract.text)
    located = [f for f in findings if f.doc]
    for f in located:
        assert contract.text[f.start:f.end] == f.quote
        cite = loc.cite(f.start, f.end)
        assert (cite.section, cite.paragraph, cite.page) == (f.section, f.paragraph, f.page)
        if f.match == "exact":
            assert f.quote == f.answer
    assert [f.rule for f in findings] == list(RULES)
    assert located, [f.answer for f in findings]
