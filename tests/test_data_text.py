"""Text helpers and our datatrove filters of the data pipeline (no executor)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("datatrove")

from datatrove.data import Document  # noqa: E402
from datatrove.pipeline.filters import FineWebQualityFilter  # noqa: E402

from glmserve.data.filters import WORDS, LanguageIdFilter, MojibakeFilter, PerLanguageFilter  # noqa: E402
from glmserve.data.text import chinese_view, fold_fullwidth, mojibake_score, repair_mojibake, unwrap  # noqa: E402

APACHE = Path("/usr/share/common-licenses/Apache-2.0")


def test_fullwidth_folds_ascii_forms_and_keeps_chinese_punctuation():
    assert fold_fullwidth("ＧＬＭ－５，版本２、《书》。") == "GLM-5,版本2、《书》。"


def test_chinese_view_splits_words_and_maps_sentence_marks():
    view = chinese_view("我们在北京学习数据工程。你好吗？")
    assert view.endswith("?") and "." in view
    assert len(view.split()) >= 5  # jieba words, not one run of characters


def test_mojibake_repaired_once_and_scored():
    clean = "Café ‘quotes’ – naïve déjà vu"
    broken = clean.encode("utf-8").decode("cp1252")
    assert mojibake_score(broken) > 1 and mojibake_score(clean) == 0
    assert repair_mojibake(broken) == clean
    assert repair_mojibake(clean) == clean


def test_mojibake_filter_repairs_or_rejects():
    f = MojibakeFilter()
    once = Document(text="Déjà vu – ‘fine’ text here. " * 5, id="a")
    once.text = once.text.encode("utf-8").decode("cp1252")
    assert f.filter(once) is True and "Déjà" in once.text
    twice = "Déjà vu – ‘broken’ text. " * 5
    for _ in range(2):
        twice = twice.encode("utf-8").decode("cp1252")
    assert f.filter(Document(text=twice, id="b")) == (False, "mojibake")


def test_language_filter_py3langid():
    f = LanguageIdFilter(("en", "zh"))
    en = Document(text="The licensor grants you a perpetual license to reproduce the work.", id="en")
    de = Document(text="Der Lizenzgeber gewährt Ihnen eine unbefristete Lizenz zur Vervielfältigung des Werkes.",
                  id="de")
    zh = Document(text="许可方授予您永久的许可，可以复制该作品。", id="zh")
    assert f.filter(en) is True and en.metadata["language"] == "en"
    assert f.filter(de) == (False, "language_de")
    assert f.filter(zh) is True and zh.metadata["language"] == "zh"


def test_unwrap_joins_wrapped_lines_and_keeps_numbered_items():
    text = ("1. Definitions.\n\n   \"License\" shall mean the terms\n   and conditions.\n(a) first item\n"
            "wrapped here.\n(b) second")
    assert unwrap(text).split("\n") == ["1. Definitions.", "\"License\" shall mean the terms and conditions.",
                                        "(a) first item wrapped here.", "(b) second"]


@pytest.mark.skipif(not APACHE.exists(), reason="Debian's license texts are not installed")
def test_fineweb_rejects_the_apache_license_as_is_but_keeps_it_unwrapped():
    """The known trap: FineWeb's line-punctuation rule counts hard-wrapped lines as paragraphs."""
    text = APACHE.read_text()
    fineweb = FineWebQualityFilter(language=WORDS)
    assert fineweb.filter(Document(text=text, id="lic"))[0] is False
    ours = PerLanguageFilter("fineweb_quality", {"en": FineWebQualityFilter(language=WORDS)}, view="unwrap")
    assert ours.filter(Document(text=text, id="lic", metadata={"language": "en"})) is True


def test_gopher_tokenizer_words_and_sentences():
    assert WORDS.word_tokenize("It's a test, isn't it?") == ["It's", "a", "test,", "isn't", "it?"]
    assert WORDS.sent_tokenize("One. Two! Three") == ["One.", "Two!", "Three"]
