"""glmserve/compress: segmentation offsets, anchors, code routing, and the trace map's promises (every kept
span is its source's exact substring at the cited offsets; structural anchors are all kept) on seeded random
documents, with the embedded SmolLM2 tokenizer and the real sentence encoder."""

from __future__ import annotations

import json
import random

import pytest
from example_modules import load_example

from glmserve.cli import main
from glmserve.compress import Document, compress
from glmserve.compress.anchors import detect, is_structural
from glmserve.compress.policy import route
from glmserve.compress.segment import segment
from glmserve.compress.tokens import default_counter
from glmserve.errors import InvalidRequestError

CHINESE = ("第一章 总则\n\n第一条 为了规范合同管理，制定本办法。本办法所称合同，是指甲方与乙方签订的协议。\n\n"
           "第二条 乙方应当在2024年3月1日前支付人民币50,000元。逾期的，按照第一条处理！")
NARRATIVE = [
    "The parties met several times to discuss the general direction of the project.",
    "Most of the meetings took place in the spring and covered routine matters.",
    "Staff were encouraged to share their views on the working arrangements.",
    "The weather during the negotiations was unusually mild for the season.",
    "Several observers noted that the atmosphere remained cordial throughout.",
    "A number of minor editorial changes were made to improve readability.",
    "The team also reviewed earlier drafts and the comments received on them.",
    "Lunch was provided on most days, and the sessions usually ended early.",
]
FACTS = [
    "The Supplier shall deliver the goods within 30 days of the order date.",
    "Late payment bears interest at 1.5% per month, see Section {ref}.",
    "The total fee is $12,500 payable on March 3, 2025.",
]


@pytest.fixture(scope="module")
def counter():
    return default_counter()


def random_contract(rng: random.Random, sections: int) -> str:
    parts = ["MASTER SERVICES AGREEMENT\n================="]
    for s in range(1, sections + 1):
        parts.append(f"{s}. Section title number {s}")
        if rng.random() < 0.5:
            parts.append(f'{s}.1 "Term{s}" means the period described in this Section {s}.')
        for _ in range(rng.randint(2, 5)):
            sentences = rng.sample(NARRATIVE, rng.randint(1, 4))
            if rng.random() < 0.4:
                sentences.append(rng.choice(FACTS).format(ref=f"{rng.randint(1, sections)}.1"))
            parts.append(" ".join(sentences))
        if rng.random() < 0.3:
            parts.append("\f")
    return "\n\n".join(parts)


def test_segments_are_exact_with_sections_paragraphs_pages() -> None:
    text = "1. Scope\n\nThis applies e.g. to all goods. It starts now.\n\f\n2. Fees\n\nPay $5 within 10 days."
    units = segment("d", text)
    assert all(text[u.start:u.end] == u.text for u in units)
    assert [(u.text, u.section, u.paragraph, u.page, u.heading) for u in units] == [
        ("1. Scope", "1", 1, 1, True),
        ("This applies e.g. to all goods.", "1", 2, 1, False),
        ("It starts now.", "1", 2, 1, False),
        ("2. Fees", "2", 3, 2, True),
        ("Pay $5 within 10 days.", "2", 4, 2, False),
    ]


def test_chinese_chapters_clauses_and_anchors() -> None:
    units = segment("c", CHINESE)
    kinds = detect(units, CHINESE)
    got = [(u.text[:6], u.section, sorted(k)) for u, k in zip(units, kinds)]
    assert got == [
        ("第一章 总则", "第一章", ["heading"]),
        ("第一条 为了", "第一条", ["clause"]),
        ("本办法所称合", "第一条", ["definition"]),
        ("第二条 乙方", "第二条", ["amount", "clause", "date"]),
        ("逾期的，按照", "第二条", ["xref"]),
    ]


def test_english_anchor_kinds() -> None:
    text = ('"Licensee" means ACME Widgets Inc. and its affiliates. Fees rise by 3% on January 1, 2026. '
            "Refunds follow Section 4.2 of this Agreement. Nothing else happens here.")
    units = segment("e", text)
    kinds = [sorted(k) for k in detect(units, text)]
    assert kinds[0] == ["definition", "entity"] and is_structural(frozenset(kinds[0]))
    assert {"amount", "date"} <= set(kinds[1])
    assert "xref" in kinds[2]
    assert kinds[3] == []


def test_code_is_routed_off_and_prose_on() -> None:
    code = "import os\n\ndef f(x):\n    y = x + 1\n    return y\n\nclass A:\n    pass\n"
    c_code = "#include <stdio.h>\nint main(void) {\n  printf(\"hi\\n\");\n  return 0;\n}\n"
    assert route(code).mode == "off" and route(c_code).mode == "off"
    assert route(random_contract(random.Random(0), 3)).mode == "on"
    assert route(CHINESE).mode == "on"


def test_commented_code_and_stubs_are_code_and_markdown_prose_with_fences_is_not() -> None:
    commented = ("/*\n * Copyright (C) 2001 Example Corporation and others.\n * All Rights Reserved.\n"
                 " * This header declares the cleanup functions of the library.\n */\n\n#ifndef CLEAN_H\n"
                 "#define CLEAN_H\n/* Frees every resource the library holds. Call it last. */\n"
                 "void lib_cleanup(void);\n#endif\n")
    stub = ("import numpy as np\n\nAR_f8: np.ndarray\nAR_U: np.ndarray\nflags: dict[str, int]\n"
            "np.polymul(AR_f8, AR_U)  # type: ignore\n")
    shell = "if test -t 1; then\n  echo \"Missing filename\" 1>&2\n  exit\nfi\n"
    assert route(commented).mode == "off" and route(stub).mode == "off" and route(shell).mode == "off"
    wrapped = ("Permission is hereby granted, free of charge, to any person obtaining a copy\n"
               "of this software and associated documentation files (the \"Software\"), to deal\n"
               "in the Software without restriction, including without limitation the rights\n"
               "to use, copy, modify, merge, publish, distribute, sublicense, and/or sell\n")
    assert route(wrapped).mode == "on"
    underlined = ("SUPPLY AGREEMENT\n================\n\n1. Payment\n\n1.1 Invoices are paid within 30 days.\n\n"
                  "Late payment bears interest.\n\nFees are in euros.\n")
    assert route(underlined).mode == "on"  # a heading's underline is no code (its == once routed it off)
    fence = "```python\nimport os\n\ndef f(x):\n    return x + 1\n```"
    markdown = (f"# Usage\n\nThe tool reads a file and prints a summary. It never writes anything.\n\n{fence}\n\n"
                "## Options\n\nEach option has a default. The defaults suit most inputs.\n")
    r = route(markdown)
    assert r.mode == "on" and "fenced" in r.reason
    assert route(f"Example:\n\n{fence}\n\n{fence}\n").mode == "off"  # mostly fenced code
    units = segment("readme", markdown)
    assert [u.text for u in units if u.text.startswith("```")] == [fence]  # one unit: kept or dropped whole
    assert all(markdown[u.start:u.end] == u.text for u in units)


@pytest.mark.parametrize("seed", range(4))
def test_trace_map_is_exact_and_keeps_every_anchor(seed: int, counter) -> None:
    rng = random.Random(seed)
    docs = [Document(f"doc{i}", random_contract(rng, rng.randint(3, 8))) for i in range(rng.randint(1, 3))]
    query = "When is the fee payable?" if seed % 2 else None
    result = compress(docs, query=query, ratio=2.5, count_tokens=counter)
    by_id = {d.id: d.text for d in docs}
    cursor = 0
    for span in result.spans:  # in document order, each verbatim in the output, in that order
        piece = by_id[span.doc][span.start:span.end]
        at = result.text.find(piece, cursor)
        assert at >= 0, piece
        cursor = at + len(piece)
    for doc in docs:
        units = segment(doc.id, doc.text)
        cited = {(s.start, s.end): s for s in result.spans if s.doc == doc.id}
        for unit, kinds in zip(units, detect(units, doc.text)):
            if (unit.start, unit.end) in cited:
                span = cited[(unit.start, unit.end)]
                assert (span.section, span.paragraph, span.page) == (unit.section, unit.paragraph, unit.page)
            if is_structural(kinds):
                assert cited[(unit.start, unit.end)].kind == "anchor"
    assert result.original_tokens == int(counter([d.text for d in docs]).sum())
    assert result.compressed_tokens == int(counter([result.text])[0])
    anchors = sum(int(counter([by_id[s.doc][s.start:s.end]])[0]) + 1 for s in result.spans if s.kind == "anchor")
    assert result.compressed_tokens <= max(-(-result.original_tokens // 2.5), anchors + 8)
    assert any(s.kind == "narrative" for s in result.spans)


def test_query_keeps_the_answer_sentence(counter) -> None:
    rng = random.Random(7)
    text = random_contract(rng, 6) + "\n\n7. Notices\n\nAll notices go to the registered office in Leeds."
    result = compress([Document("c", text)], query="Where do notices go?", ratio=4, count_tokens=counter)
    assert "All notices go to the registered office in Leeds." in result.text
    assert result.ratio >= 2.5


def test_bad_budgets_are_typed_errors(counter) -> None:
    docs = [Document("a", "Some text. More text.")]
    for kwargs in ({"ratio": 0.5}, {"ratio": 2, "target_tokens": 10}, {"target_tokens": 0}, {"preset": "huge"}):
        with pytest.raises(InvalidRequestError):
            compress(docs, count_tokens=counter, **kwargs)
    with pytest.raises(InvalidRequestError):
        compress([], count_tokens=counter)
    with pytest.raises(InvalidRequestError):
        compress([docs[0], docs[0]], count_tokens=counter)


def test_cli_json(tmp_path, capsys, counter) -> None:
    path = tmp_path / "contract.txt"
    path.write_text(random_contract(random.Random(3), 5), encoding="utf-8")
    main(["compress", str(path), "--query", "fee", "--target-tokens", "200", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["compressed_tokens"] <= 200 < out["original_tokens"]
    text = path.read_text(encoding="utf-8")
    assert out["spans"] and all(text[s["start"]:s["end"]] in out["text"] for s in out["spans"])
    assert {s["kind"] for s in out["spans"]} == {"anchor", "narrative"}


def test_contract_review_example_cites_findings(tmp_path, capsys) -> None:
    module = load_example("contract_review")
    rng = random.Random(11)
    contract = random_contract(rng, 6) + (
        "\n\n7. Payment\n\nLate payments bear interest at 3% per month."
        "\n\n8. Liability\n\nThe total liability of the Supplier is limited to the fees paid."
        "\n\n9. Law\n\nThis Agreement is governed by the laws of England.")
    path = tmp_path / "contract.txt"
    path.write_text(contract, encoding="utf-8")
    module.main([str(path), "--rate-cap", "24", "--json"])
    found = json.loads(capsys.readouterr().out)
    findings = {f["rule"]: f for f in found if f["rule"] != "rate_cap"}
    [rate] = [f for f in found if f["rule"] == "rate_cap" and f["status"] == "violation"]
    assert rate["section"] == "7" and "36% a year" in rate["note"]
    assert contract[contract.index(rate["quote"]):].startswith("Late payments bear interest at 3% per month.")
    assert findings["liability"]["status"] == "ok" and findings["liability"]["section"] == "8"
    assert findings["governing_law"]["section"] == "9"
    assert findings["guarantee"]["status"] == "missing"


def test_neighbour_relevance_stays_within_a_section() -> None:
    import numpy as np

    from glmserve.compress.select import with_neighbours

    rel = np.array([0.0, 1.0, 0.0, 0.0, 0.5])
    group = np.array([0, 0, 0, 1, 1])  # two sections: the neighbour across the boundary does not count
    np.testing.assert_allclose(with_neighbours(rel, group, weight=0.5, between=0.0), [0.5, 1.0, 0.5, 0.25, 0.5])
    np.testing.assert_allclose(with_neighbours(rel, group, weight=0.0, between=0.0), rel)


def test_between_term_rewards_a_unit_both_of_whose_neighbours_are_relevant() -> None:
    import numpy as np

    from glmserve.compress.select import with_neighbours

    rel = np.array([1.0, 0.0, 0.8, 0.0, 0.0, 0.6])
    group = np.array([0, 0, 0, 0, 1, 1])  # unit 3's next neighbour is in another section: it has no smaller one
    np.testing.assert_allclose(with_neighbours(rel, group, weight=0.0, between=0.5), [1.0, 0.4, 0.8, 0.0, 0.0, 0.6])
    np.testing.assert_allclose(with_neighbours(rel, group, weight=0.5, between=0.5), [1.0, 0.9, 0.8, 0.4, 0.3, 0.6])

