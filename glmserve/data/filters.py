"""Our datatrove filter steps: mojibake repair/rejection, language identification with py3langid (its model
ships in the wheel; datatrove's own LanguageFilter downloads a fastText model at run time), the document length
(words of the whole text; jieba words for Chinese), and a wrapper that runs a datatrove filter per language on a
view of the text (prose, unwrapped paragraphs; jieba words for Chinese) whose rejections the learned quality
score may overrule."""

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

from glmserve.data.text import (
    chinese_view,
    chinese_words,
    cjk_share,
    fold_fullwidth_alnum,
    mojibake_score,
    prose,
    repair_mojibake,
    unwrap,
)


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
    """Repairs one round of UTF-8 read as cp1252/Latin-1/GBK/Big5 and folds full-width letters and digits to
    ASCII; drops a document whose marks stay above `max_marks_per_100_chars` after the repair."""

    name = "mojibake"

    def __init__(self, max_marks_per_100_chars: float = 0.3, exclusion_writer: DiskWriter | None = None):
        super().__init__(exclusion_writer)
        self.max_marks = max_marks_per_100_chars

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        fixed = repair_mojibake(doc.text)
        if fixed != doc.text:
            self.stat_update("repaired")
            doc.text = fixed
        folded = fold_fullwidth_alnum(doc.text)
        if folded != doc.text:
            self.stat_update("fullwidth_folded")
            doc.text = folded
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


class LengthFilter(BaseFilter):
    """Drops documents under `min_words` words of their whole text (Gopher's 50, Rae et al. 2021, App. A.1.1):
    the length is the document's, code included, while the word statistics of the later rules are judged on
    its prose. Chinese words are jieba's."""

    name = "length"

    def __init__(self, min_words: int = 50, exclusion_writer: DiskWriter | None = None):
        super().__init__(exclusion_writer)
        self.min_words = min_words

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        text = doc.text
        words = len(chinese_words(text)) if doc.metadata.get("language") == "zh" else len(text.split())
        return True if words >= self.min_words else (False, "too_short")


VIEWS: dict[str, Callable[[str], str]] = {"raw": lambda t: t, "unwrap": unwrap, "prose": prose}


class PerLanguageFilter(BaseFilter):
    """Runs one datatrove filter per document language (`by_language`, with 'en' as the fallback) on a view
    of the text, leaving the document's text itself unchanged (C4's filter would otherwise drop lines).
    Chinese documents are seen as jieba words with sentence punctuation in its ASCII role. With `rescue_score`,
    a rejection is overruled when the quality model (`quality_model`: a path, or None for the shipped one) gives
    the document at least that probability of being valid: the published thresholds are for web text, and
    technical prose (API references, READMEs) fails them for the wrong reasons."""

    def __init__(self, name: str, by_language: dict[str, BaseFilter], view: str = "raw",
                 rescue_score: float | None = None, quality_model: str | None = None,
                 exclusion_writer: DiskWriter | None = None):
        if view not in VIEWS:
            raise ValueError(f"unknown view {view!r} (one of {sorted(VIEWS)})")
        self.name = name
        super().__init__(exclusion_writer)
        self.by_language = by_language
        self.view = view
        self.rescue_score = rescue_score
        self.quality_model = quality_model

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        lang = doc.metadata.get("language", "en")
        inner = self.by_language.get(lang, self.by_language["en"])
        text = VIEWS[self.view](doc.text)
        if lang == "zh":
            text = chinese_view(text)
        if not text.strip():
            return False, "empty"
        verdict = inner.filter(Document(text=text, id=doc.id, metadata=dict(doc.metadata)))
        if verdict is True or (verdict is not False and verdict[0]) or self.rescue_score is None:
            return verdict
        from glmserve.data.quality import load_model

        score = float(load_model(self.quality_model).score([doc.text])[0])
        if score < self.rescue_score:
            return verdict
        self.stat_update("rescued_by_quality")
        why = f"{self.name}:{verdict[1] if isinstance(verdict, tuple) else self.name}"
        doc.metadata["rescued"] = ",".join(filter(None, (doc.metadata.get("rescued"), why)))  # every rule overruled
        return True
