"""PII scrubbing: Presidio with the offline spaCy model plus our Chinese recognizers; `glmserve data scrub`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("presidio_analyzer")

from glmserve.cli import main  # noqa: E402
from glmserve.data.corpus import build_pii_corpus  # noqa: E402
from glmserve.data.pii import is_resident_id, scrub_text  # noqa: E402
from glmserve.data.records import read_records, write_records  # noqa: E402


def test_resident_id_checksum_and_birth_date():
    assert is_resident_id("11010519491231002X") and is_resident_id("11010519491231002x")
    assert not is_resident_id("110105194912310021")  # wrong check character
    assert not is_resident_id("110105194913310020")  # month 13


def test_chinese_record_scrubbed_with_same_shape_placeholders():
    text = ("客户姓名：张伟，身份证号11010519491231002X，手机138-1234-5678，邮箱zhangwei@qq.com，"
            "银行卡6222021234567890128，登录IP为202.96.128.86。")
    out, found = scrub_text(text)
    assert {f["entity"] for f in found} >= {"CN_NAME", "CN_RESIDENT_ID", "CN_MOBILE", "EMAIL_ADDRESS",
                                           "BANK_CARD", "IP_ADDRESS"}
    assert "00000000000000000X" in out and "000-0000-0000" in out and "000.00.000.00" in out
    assert "user1@example.com" in out and "PERSON_1" in out and "张伟" not in out
    assert out.startswith("客户姓名：PERSON_1，身份证号")  # the surrounding Chinese text is untouched


def test_english_record_and_repeated_names_keep_coreference():
    out, _ = scrub_text("John Smith wrote to jsmith@example.org from 10.1.2.3. Later John Smith called "
                        "+1 212-736-5000 and paid with 4111 1111 1111 1111.")
    assert out.count("PERSON_1") == 2 and "user1@example.com" in out
    assert "0000 0000 0000 0000" in out and "00.0.0.0" in out and "212" not in out


@pytest.mark.parametrize("text", [
    "Order number 110105194912310021 was shipped.",       # ID layout, wrong check character
    "Tracking code 1234 5678 9012 3456 is not a card.",    # fails Luhn
    "See section 4.2.1.3 of the manual, version 2.10.1.4.",
    "ISBN 978-3-16-148410-0, printed 2019-04-12, 1024 2048 4096 bytes.",
    "Apache License, Version 2.0, January 2004. See clause 4(a) and 7.",
])
def test_lookalikes_are_left_alone(text: str):
    assert scrub_text(text) == (text, [])


def test_planted_corpus_recall_and_hard_negatives():
    corpus = build_pii_corpus(seed=5, per_type=4)
    for rec in corpus:
        out, found = scrub_text(rec["text"])
        if rec["planted"]:
            assert rec["planted"]["value"] not in out, rec
        else:
            assert found == [], rec


def test_scrub_cli_keeps_ids(tmp_path: Path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_records(src, [{"id": "a", "text": "Mail me at li.na@163.com.", "lang": "en"},
                        {"id": "b", "text": "Nothing personal here."}])
    main(["data", "scrub", str(src), "--out", str(dst)])
    assert json.loads(capsys.readouterr().out)["records"] == 2
    out = list(read_records(dst))
    assert [r["id"] for r in out] == ["a", "b"] and out[0]["lang"] == "en"
    assert out[0]["text"] == "Mail me at user1@example.com." and out[0]["pii"] == ["EMAIL_ADDRESS"]
    assert out[1]["text"] == "Nothing personal here." and out[1]["pii"] == []
