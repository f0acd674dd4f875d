"""Our datatrove filter steps: mojibake repair/rejection, language identification with py3langid (its model
ships in the wheel; datatrove's own LanguageFilter downloads a fastText model at run time), and a wrapper that
runs a datatrove filter per language on a view of the text (unwrapped paragraphs; jieba words for Chinese)."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache

import regex
from datatrove.data import Document
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.pipeline.writers.disk_base import DiskWriter
from datatrove.utils.text import TERMINAL_PUNCTUATION
from datatrove.utils.word_tokenizers import WordTokenizer, simple_span_tokenize

from glmserve.data.text import chinese_view, cjk_share, mojibake_score, prose, repair_mojibake, unwrap


class GopherWordTokenizer(WordTokenizer):
    """Words as Gopher defines them, whitespace-separated tokens (Rae et al. 2021, App. A.1.1): datatrove's
    spaCy tokenizer splits off punctuation, so that the rule "80% of words hold a letter" fails ordinary
    prose with parentheses and commas; spaCy's import also costs seconds per process. Sentences end at a
    terminal mark or a newline (the rule of datatrove's WhitespaceTokenizer, keeping an unterminated tail)."""

    _sent = regex.compile(rf"(?:(?:\p{{Lu}}\.)|.)+?[{re.escape(''.join(TERMINAL_PUNCTUATION))}\n]+[\"'\u201d]?")

    def word_tokenize(self, text: str) -> list[str]:
        return text.split()

    def sent_tokenize(self, text: str) -> list[str]:
        sents, end = [], 0
        for m in self._sent.finditer(text):
            sents.append(m.group().strip())
            end = m.end()
        sents.append(text[end:].strip())  # a last sentence without its mark
        return [s for s in sents if s]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        return list(simple_span_tokenize(text, self.sent_tokenize(text)))


WORDS = GopherWordTokenizer()


class MojibakeFilter(BaseFilter):
    """Repairs one round of UTF-8 read as cp1252/Latin-1; drops a document whose marks stay above
    `max_marks_per_100_chars` after the repair."""

    name = "mojibake"

    def __init__(self, max_marks_per_100_chars: float = 0.3, exclusion_writer: DiskWriter | None = None):
        super().__init__(exclusion_writer)
        self.max_marks = max_marks_per_100_chars

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        fixed = repair_mojibake(doc.text)
        if fixed != doc.text:
            self.stat_update("repaired")
            doc.text = fixed
        if mojibake_score(doc.text) > self.max_marks:
            return False, "mojibake"
        return True


@lru_cache(maxsize=1)
def _identifier():
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


def identify_language(text: str) -> tuple[str, float]:
    """(ISO 639-1 code, probability) by py3langid's shipped model; CJK-dominated text is 'zh'."""
    if cjk_share(text) > 0.3:
        return "zh", 1.0
    lang, prob = _identifier().classify(text[:4000])
    return lang, float(prob)


class LanguageIdFilter(BaseFilter):
    """Keeps documents in `languages` identified with at least `min_probability`; records `language`."""

    name = "language"

    def __init__(self, languages: tuple[str, ...] = ("en", "zh"), min_probability: float = 0.65,
                 exclusion_writer: DiskWriter | None = None):
        super().__init__(exclusion_writer)
        self.languages = tuple(languages)
        self.min_probability = min_probability

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        lang, prob = identify_language(doc.text)
        doc.metadata["language"] = lang
        if lang not in self.languages:
            return False, f"language_{lang}"
        if prob < self.min_probability:
            return False, "language_uncertain"
        return True


VIEWS: dict[str, Callable[[str], str]] = {"raw": lambda t: t, "unwrap": unwrap, "prose": prose}


class PerLanguageFilter(BaseFilter):
    """Runs one datatrove filter per document language (`by_language`, with 'en' as the fallback) on a view
    of the text, leaving the document's text itself unchanged (C4's filter would otherwise drop lines).
    Chinese documents are seen as jieba words with sentence punctuation in its ASCII role."""

    def __init__(self, name: str, by_language: dict[str, BaseFilter], view: str = "raw",
                 exclusion_writer: DiskWriter | None = None):
        if view not in VIEWS:
            raise ValueError(f"unknown view {view!r} (one of {sorted(VIEWS)})")
        self.name = name
        super().__init__(exclusion_writer)
        self.by_language = by_language
        self.view = view

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        lang = doc.metadata.get("language", "en")
        inner = self.by_language.get(lang, self.by_language["en"])
        text = VIEWS[self.view](doc.text)
        if lang == "zh":
            text = chinese_view(text)
        if not text.strip():
            return False, "empty"
        return inner.filter(Document(text=text, id=doc.id, metadata=dict(doc.metadata)))
