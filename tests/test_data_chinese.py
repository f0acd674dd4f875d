"""Chinese documents in the data pipeline: mojibake of UTF-8 read as GBK or Big5 (repaired when lossless,
rejected when not), full-width letters and digits folded, length counted in jieba words; the prose view that
the rule filters judge (code, doctests, headings left out)."""

from __future__ import annotations

import pytest

pytest.importorskip("datatrove")

from datatrove.data import Document  # noqa: E402

from glmserve.data.filters import LengthFilter, MojibakeFilter  # noqa: E402
from glmserve.data.text import fold_fullwidth_alnum, mojibake_score, prose, repair_mojibake  # noqa: E402

ZH = ("许可方授予您永久的、全球的、免费的许可，可以复制、修改和发布该作品。使用者应当保留原有的版权声明，"
      "并在修改后的文件中注明所做的更改。本许可不授予使用商标的权利。") * 3
ZH_TW = "本教程的設計目標是講述一些必要的基本命令，而掌握好這些命令，您就能夠很容易將編輯器當作一個通用的工具來使用了。"


@pytest.mark.parametrize("codec", ["gbk", "big5"])
def test_utf8_read_as_a_chinese_codec_is_scored_and_rejected_when_bytes_were_lost(codec: str):
    broken = ZH.encode("utf-8").decode(codec, errors="ignore")
    assert mojibake_score(ZH) == 0 and mojibake_score(ZH_TW) == 0  # simplified and traditional prose
    assert mojibake_score(broken) > 10
    assert MojibakeFilter().filter(Document(text=broken, id="x")) == (False, "mojibake")


def test_lossless_gbk_mojibake_is_repaired():
    text = "数据" * 30  # UTF-8 bytes that happen to decode as GBK without loss
    broken = text.encode("utf-8").decode("gbk")
    assert repair_mojibake(broken) == text
    doc = Document(text=broken, id="r")
    assert MojibakeFilter().filter(doc) is True and doc.text == text


def test_fullwidth_letters_and_digits_are_folded_in_the_kept_text_and_punctuation_stays():
    assert fold_fullwidth_alnum("版本ＧＬＭ５，共１２页。") == "版本GLM5，共12页。"
    doc = Document(text="ＶＩＭ教程第１讲，" + ZH, id="w")
    assert MojibakeFilter().filter(doc) is True and doc.text.startswith("VIM教程第1讲，")


def test_length_counts_jieba_words_for_chinese():
    f = LengthFilter(min_words=50)
    assert f.filter(Document(text=ZH, id="zh", metadata={"language": "zh"})) is True  # no spaces, >50 words
    assert f.filter(Document(text=ZH[:30], id="s", metadata={"language": "zh"})) == (False, "too_short")
    assert f.filter(Document(text="word " * 49, id="e", metadata={"language": "en"})) == (False, "too_short")


def test_prose_view_leaves_out_code_doctests_headings_and_link_urls():
    doc = ("# Enum\n\nCreate a collection of name/value pairs.\n\n>>> Color.RED\n<Color.RED: 1>\n\n"
           "```python\nimport enum\n```\n\nSee [the docs](https://example.com/a_b) for details.\n\n"
           "LD_LIBRARY_PATH=/usr/lib strace true 2>&1 | fgrep \"open(\\\"/usr/lib\"\n\n"
           "Title\n=====\n\nLast words of the document.\n<!-- hidden -->")
    assert prose(doc).split("\n") == ["Create a collection of name/value pairs.", "See the docs for details.",
                                      "Last words of the document."]


def test_roff_text_keeps_the_words_of_a_man_page():
    from glmserve.data.corpus import roff_text

    src = ('.TH "USERADD" "8"\n.SH "名称"\nuseradd \\- 创建一个新用户\n.SH "描述"\n.PP\n\\fBuseradd\\fR\n'
           "是一个添加用户的底层工具\\&。\n")
    assert roff_text(src) == "名称\nuseradd - 创建一个新用户\n\n描述\n\nuseradd\n是一个添加用户的底层工具。"
