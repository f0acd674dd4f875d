"""The drafting assistant's consistency checks (glmserve/compress/drafting): time logic, referents defined
before use, glossary spelling; each on texts written here with a positive and a negative case, and every
finding's citation checked against the text (quote == text[start:end], section and paragraph)."""

from __future__ import annotations

import json

import pytest

from glmserve.cli import main
from glmserve.compress.drafting import check_draft, parse_glossary
from glmserve.compress.drafting.dates import dates, durations
from glmserve.compress.drafting.glossary import osa_distance
from glmserve.errors import InvalidRequestError


def checks(text: str, **kw) -> list[tuple[str, str]]:
    """(check, quote) of every finding, after checking that each cites its own text exactly."""
    found = check_draft(text, **kw)
    for f in found:
        assert f.quote == text[f.at.start:f.at.end]
        if f.related is not None:
            assert 0 <= f.related.start < f.related.end <= len(text)
    return [(f.check, f.quote) for f in found]


def kinds(text: str, **kw) -> list[str]:
    return [c for c, _ in checks(text, **kw)]


def test_dates_and_durations_parse() -> None:
    text = "On 2025-03-01, March 5, 2025, 7 April 2025, 2024年3月1日 and 2025-02-30 (no such day)."
    assert [d.date.isoformat() for d in dates(text)] == ["2025-03-01", "2025-03-05", "2025-04-07", "2024-03-01"]
    spans = durations("thirty (30) days, a 3-month pilot, two years, 10 business days and 2 weeks")
    assert [(d.amount, d.family) for d in spans] == [(30, "days"), (3, "months"), (24, "months"),
                                                     (10, "business days"), (14, "days")]


@pytest.mark.parametrize(("sentence", "bad"), [
    ("Delivery is on 2025-04-10, before the inspection on 2025-04-01.", True),
    ("Delivery is on 2025-03-28, before the inspection on 2025-04-01.", False),
    ("Payment falls on 1 May 2025, after the audit on April 2, 2025.", False),
    ("Payment falls on 1 March 2025, after the audit on April 2, 2025.", True),
    ("Notice is given on 2025-06-02, no later than 2025-06-01.", True),
    ("Notice is given on 2025-06-01, no later than 2025-06-01.", False),
    ("The pilot runs from 2025-05-01 to 2025-04-01.", True),
    ("The pilot runs from 2025-04-01 to 2025-05-01.", False),
    # a clause break: "before" belongs to the second clause, whose left side has no date
    ("Delivery is on 2025-04-10; the report is due before the inspection on 2025-04-01.", False),
])
def test_time_order(sentence: str, bad: bool) -> None:
    assert ("time_order" in kinds(sentence)) == bad


def test_time_order_against_a_defined_event() -> None:
    text = ('The "Closing Date" is 30 June 2025.\n\nThe Seller shall deliver the deed on 2025-07-15, before the '
            "Closing Date.\n\nThe buyer pays on 2025-06-01, before the Closing Date.")
    found = check_draft(text)
    assert [f.check for f in found] == ["time_order"]
    assert "Closing Date (2025-06-30)" in found[0].message and found[0].at.paragraph == 2
    unquoted = "The Effective Date is 1 March 2025. Payment is due on 2025-02-15, after the Effective Date."
    assert kinds(unquoted) == ["time_order"]
    assert kinds(unquoted.replace("2025-02-15", "2025-03-15")) == []


@pytest.mark.parametrize(("sentence", "check", "bad"), [
    ("The project has a total term of 12 months, consisting of a 3-month pilot and a 6-month rollout.",
     "duration_sum", True),
    ("The project has a total term of 12 months, consisting of a 6-month pilot and a 6-month rollout.",
     "duration_sum", False),
    ("The warranty lasts two years, divided into 12 months of full cover and 12 months of parts only.",
     "duration_sum", False),
    ("The review period of 3 weeks comprises 10 days of testing and 7 days of fixes.", "duration_sum", True),
    ("The term runs from 2025-01-01 to 2025-03-31 (90 days).", "date_span", False),
    ("The term runs from 2025-01-01 to 2025-03-31 (60 days).", "date_span", True),
    ("The lease runs from 1 January 2025 to 31 December 2025, a period of 12 months.", "date_span", False),
    ("The lease runs from 1 January 2025 to 31 December 2025, a period of 6 months.", "date_span", True),
    ("The report is due on 2025-05-01, 30 days after the inspection on 2025-04-01.", "date_offset", False),
    ("The report is due on 2025-05-20, 30 days after the inspection on 2025-04-01.", "date_offset", True),
])
def test_durations_add_up(sentence: str, check: str, bad: bool) -> None:
    assert (check in kinds(sentence)) == bad


def test_defined_terms_before_use_and_twice() -> None:
    text = ("1. Scope\n\nThe Supplier delivers the goods.\n\n"
            '2. Definitions\n\n"Supplier" means Acme Ltd. Acme Retail (the "Buyer") buys them. The Buyer pays.\n\n'
            '3. Other\n\n"Supplier" means Beta Ltd.')
    found = check_draft(text)
    got = {(f.check, f.quote): f for f in found}
    early = got[("defined_before_use", "Supplier")]
    assert early.at.section == "1" and early.at.paragraph == 2  # cited where the use is
    assert early.related.section == "2" and text[early.related.start:early.related.end] == "Supplier"
    assert ("defined_twice", "Supplier") in got and got[("defined_twice", "Supplier")].at.section == "3"
    assert not any(q == "Buyer" for _, q in got)  # "Buyer" is defined before its first use
    assert kinds('"Supplier" means Acme Ltd.\n\nThe Supplier delivers.') == []


def test_abbreviations() -> None:
    text = ("The SLA applies.\n\nThe Service Level Agreement (SLA) is attached. The KPI report and the DPA follow. "
            "A Key Performance Indicator (KPI) is measured monthly in USD. MASTER SERVICES AGREEMENT. Part II.")
    found = checks(text)
    assert ("abbreviation_before_use", "SLA") in found
    assert ("abbreviation_before_use", "KPI") in found
    assert ("abbreviation_undefined", "DPA") in found
    assert len(found) == 3  # USD is common; the all-caps title and roman numerals are no abbreviations
    assert kinds("The Data Protection Addendum (DPA) applies. The DPA is signed.") == []
    assert kinds("The DPA is signed.", known_abbreviations=["DPA"]) == []


GLOSSARY = parse_glossary(["# policy terms", "email = electronic mail", "Data Controller", "Licensee",
                           "personal data"])


@pytest.mark.parametrize(("text", "found"), [
    ("Send an e-mail to the Licensee.", [("term_variant", "e-mail")]),
    ("Send an electronic mail to the Licensee.", [("term_variant", "electronic mail")]),
    ("Send an email to the Licensees.", []),
    ("Email the Licensee's agent.", []),  # a lower-case term may open a sentence; possessive
    ("The data controller decides.", [("term_variant", "data controller")]),
    ("The Data-Controller decides.", [("term_variant", "Data-Controller")]),
    ("The Data Controller decides.", []),
    ("The Licencee pays.", [("term_misspelling", "Licencee")]),
    ("The Licensor pays.", []),  # two letters off: another word
    ("Keep personal  data safe.", [("term_variant", "personal  data")]),
])
def test_glossary_spelling(text: str, found: list[tuple[str, str]]) -> None:
    assert checks(text, glossary=GLOSSARY) == found


def test_glossary_errors_and_distance() -> None:
    with pytest.raises(InvalidRequestError, match="no term"):
        parse_glossary(["# nothing", ""])
    with pytest.raises(InvalidRequestError, match=":2:"):
        parse_glossary(["email", "= variant"])
    assert osa_distance("licencee", "licensee", 1) == 1 and osa_distance("abcd", "abdc", 1) == 1
    assert osa_distance("licensor", "licensee", 1) == 2


def test_cli_check_json_and_exit_status(tmp_path, capsys) -> None:
    draft = tmp_path / "draft.txt"
    draft.write_text("1. Terms\n\nThe Licencee uses the API.\n\n2. Dates\n\nDelivery is on 2025-04-10, before "
                     "the inspection on 2025-04-01.", encoding="utf-8")
    glossary = tmp_path / "glossary.txt"
    glossary.write_text("Licensee\n", encoding="utf-8")
    with pytest.raises(SystemExit) as exit_info:
        main(["draft", "check", str(draft), "--glossary", str(glossary), "--json"])
    assert exit_info.value.code == 1
    out = json.loads(capsys.readouterr().out)
    assert [(f["check"], f["at"]["section"]) for f in out] == [("term_misspelling", "1"), ("time_order", "2")]
    clean = tmp_path / "clean.txt"
    clean.write_text("The Licensee pays on time.", encoding="utf-8")
    main(["draft", "check", str(clean), "--glossary", str(glossary)])  # no finding: exit status 0
    with pytest.raises(SystemExit) as exit_info:
        main(["draft", "check", str(tmp_path / "missing.txt")])
    assert exit_info.value.code == 2 and "cannot read" in capsys.readouterr().err
