"""The labeled noisy corpus for the cleaning benchmark, built offline from texts on this machine: Python's
standard-library docstrings and Debian's /usr/share/doc as valid documents, Chinese ones from Debian's zh_CN/zh_TW
man pages and Vim's Chinese tutor lessons (also with full-width letters and digits, still valid),
/usr/share/common-licenses as hard negatives (with generated numbered-clause lists and tables),
/usr/share/locale translations as wrong-language text, Chinese read with the wrong codec and full-width spam
as Chinese noise; mixed to a valid share (68% by default) with labeled noise. Every record has `id`, `text`, `valid`,
`kind` (valid kinds or the noise type) and `source`; near duplicates carry their exact `jaccard` to the
original on MinHash's shingles (word 5-grams of datatrove's simplified text). A PII corpus plants IDs, cards,
e-mails, phones and IPs with their spans beside hard negatives that look alike."""

from __future__ import annotations

import ast
import base64
import gettext
import gzip
import hashlib
import os
import random
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from glmserve.data.text import cjk_share

MIN_WORDS = 80
MAX_CHARS = 12_000
NOISE_KINDS = ("exact_dup", "near_dup", "boilerplate", "navigation", "minified_code", "base64", "log", "mojibake",
               "wrong_language", "too_short", "keyword_spam", "zh_mojibake", "zh_spam")
VALID_KINDS = ("document", "zh_document", "zh_fullwidth", "license", "clauses", "table")
MIN_ZH_CHARS = 300


def shingles(text: str, n: int = 5) -> set[str]:
    """Word n-grams of datatrove's simplified text (what its MinHash signatures hash)."""
    from datatrove.utils.text import TextNormConfig, simplify_text

    from glmserve.data.filters import WORDS

    words = WORDS.word_tokenize(simplify_text(text, TextNormConfig()))
    return {" ".join(words[i:i + n]) for i in range(max(0, len(words) - n + 1))}


def jaccard(a: str, b: str) -> float:
    sa, sb = shingles(a), shingles(b)
    return len(sa & sb) / len(sa | sb) if sa | sb else 1.0


def _ok(text: str) -> bool:
    words = text.split()
    return len(words) >= MIN_WORDS and len(text) <= MAX_CHARS and sum(c.isascii() for c in text) > 0.98 * len(text)


def python_docstrings() -> Iterator[tuple[str, str]]:
    """(source, text) of long module and class docstrings of the standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(part in rel for part in ("test", "idlelib", "site-packages", "lib2to3", "turtledemo")):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in [tree, *(n for n in tree.body if isinstance(n, ast.ClassDef))]:
            doc = ast.get_docstring(node)
            if doc and _ok(doc):
                yield f"python:{rel}:{getattr(node, 'name', '')}", doc


def debian_docs(root: str = "/usr/share/doc") -> Iterator[tuple[str, str]]:
    """(source, text) of plain-text READMEs and specs under /usr/share/doc (gzip ones too)."""
    for path in sorted(Path(root).rglob("*")):
        name = path.name.lower()
        rel = path.relative_to(root).as_posix().lower()
        if (not path.is_file() or "changelog" in name or name == "copyright" or "html" in name
                or "test" in rel or "/examples/" in rel):  # markup, test data and sample files are no prose
            continue
        if not (name.startswith(("readme", "news", "faq")) or name.endswith((".txt", ".txt.gz", ".md"))):
            continue
        try:
            raw = gzip.decompress(path.read_bytes()) if name.endswith(".gz") else path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, gzip.BadGzipFile):
            continue
        if _ok(text):
            yield f"debian:{path.relative_to(root).as_posix()}", text


_ROFF_ESCAPE = re.compile(r"\\f[BIRP]|\\f\(..|\\&|\\\*\(..|\\\(..|\\[ e|]")


def roff_text(source: str) -> str:
    """The text of a man page's roff source: macro lines dropped (section titles kept), font and character
    escapes removed."""
    out = []
    for line in source.split("\n"):
        if line.startswith((".SH", ".SS")):
            out += ["", line.partition(" ")[2].strip('"')]
        elif line.startswith((".", "'")):
            out += [""] if line.startswith((".PP", ".sp", ".TP", ".IP")) else []
        else:
            out.append(_ROFF_ESCAPE.sub("", line.replace("\\-", "-")))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


def chinese_docs() -> Iterator[tuple[str, str]]:
    """(source, text) of Chinese prose: Debian's zh_CN/zh_TW man pages (the mostly translated ones) and the
    lessons of Vim's Chinese tutors (simplified and traditional)."""
    for path in sorted(Path("/usr/share/man").glob("zh_*/man*/*.gz")):
        try:
            text = roff_text(gzip.decompress(path.read_bytes()).decode("utf-8"))
        except (OSError, UnicodeDecodeError, gzip.BadGzipFile):
            continue
        if cjk_share(text) >= 0.4 and len(text) >= MIN_ZH_CHARS:
            yield f"man:{path.relative_to('/usr/share/man').as_posix()}", text[:MAX_CHARS]
    # tutor.zh.utf-8 is a copy of tutor.zh_tw.utf-8
    for path in sorted(Path("/usr/share/vim").glob("vim*/tutor/tutor.zh_*.utf-8")):
        lessons = re.split(r"\n~{20,}\n", path.read_text(encoding="utf-8"))
        for i, lesson in enumerate(lessons):
            if cjk_share(lesson) >= 0.3 and len(lesson) >= MIN_ZH_CHARS:
                yield f"vim:{path.name}:{i}", lesson.strip()


def to_fullwidth(text: str) -> str:
    """ASCII letters and digits in their full-width forms (as some Chinese input methods type them)."""
    return "".join(chr(ord(c) + 0xFEE0) if c.isascii() and c.isalnum() else c for c in text)


def licenses(root: str = "/usr/share/common-licenses") -> Iterator[tuple[str, str]]:
    seen = set()
    for path in sorted(Path(root).glob("*")):
        real = os.path.realpath(path)
        if real in seen or not path.is_file():
            continue
        seen.add(real)
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) <= 4 * MAX_CHARS:
            yield f"license:{path.name}", text[:MAX_CHARS]


def foreign_sentences(langs: tuple[str, ...] = ("de", "fr", "es")) -> dict[str, list[str]]:
    """Translated messages (longer than 60 characters) of the gettext catalogs under /usr/share/locale."""
    out: dict[str, list[str]] = {}
    for lang in langs:
        sents: list[str] = []
        for path in sorted(Path(f"/usr/share/locale/{lang}/LC_MESSAGES").glob("*.mo")):
            try:
                with open(path, "rb") as f:
                    catalog = gettext.GNUTranslations(f)._catalog
            except (OSError, UnicodeDecodeError):
                continue
            sents += [v.replace("\n", " ").strip() for k, v in catalog.items()
                      if isinstance(v, str) and k and len(v) > 60 and "%" not in v]
        if sents:
            out[lang] = sorted(set(sents))
    return out


def _unique(docs: list[tuple[str, str]], max_overlap: float = 0.3) -> list[tuple[str, str]]:
    """Drops documents sharing more than `max_overlap` of their shingles with an earlier one (sources repeat
    READMEs and docstrings), so that only planted duplicates are duplicates."""
    owner: dict[str, int] = {}
    kept = []
    for src, text in docs:
        sh = shingles(text)
        if not sh or sum(1 for s in sh if s in owner) > max_overlap * len(sh):
            continue
        for s in sh:
            owner.setdefault(s, len(kept))
        kept.append((src, text))
    return kept


def _sentences(texts: list[str]) -> list[str]:
    out = []
    for t in texts:
        for s in " ".join(t.split()).split(". "):
            if 8 <= len(s.split()) <= 30 and s[0].isupper():
                out.append(s.rstrip(".") + ".")
    return out


def _clauses(rng: random.Random, sents: list[str]) -> str:
    head = rng.choice(["Terms and conditions", "Conditions of use", "Contributor agreement", "Policy"])
    body = [f"{i}. {s}" for i, s in enumerate(rng.sample(sents, rng.randint(8, 14)), 1)]
    return f"{head}\n\nThe following clauses apply to every party.\n\n" + "\n".join(body)


def _table(rng: random.Random, sents: list[str]) -> str:
    rows = [f"| {rng.choice(['alpha', 'beta', 'gamma', 'delta', 'omega'])}-{i:02d} | {rng.randint(1, 999):>5} | "
            f"{rng.random():.3f} | {rng.choice(['yes', 'no'])} |" for i in range(rng.randint(8, 16))]
    intro = " ".join(rng.sample(sents, 5))
    return (f"{intro}\n\n| name | count | ratio | enabled |\n|------|-------|-------|---------|\n" + "\n".join(rows)
            + "\n\n" + " ".join(rng.sample(sents, 3)))


def _near_dup(rng: random.Random, text: str, target: float) -> tuple[str, float]:
    """`text` with words replaced until the shingle Jaccard is close to `target`; returns (text, jaccard)."""
    words = text.split(" ")
    # replacing a fraction p of words leaves about (1-p)^5 of the 5-grams: J ~ (1-p)^5 / (2 - (1-p)^5)
    keep = (2 * target / (1 + target)) ** (1 / 5)
    edited = [w if rng.random() < keep else rng.choice(["data", "value", "system", "file", "item"]) for w in words]
    out = " ".join(edited)
    return out, jaccard(text, out)


BOILERPLATE = ["We use cookies to improve your experience.", "Accept all cookies", "Privacy policy",
               "Terms of use", "All rights reserved.", "Subscribe to our newsletter", "Share this page",
               "Copyright 2024 Example Corp.", "Sign in", "Follow us on social media", "Back to top"]
NAV = ["Home", "About", "Products", "Pricing", "Blog", "Contact", "Docs", "Login", "Careers", "Support"]
ZH_SPAM = ["特价", "优惠", "免费", "包邮", "秒杀", "ＶＩＰ", "热卖", "抢购", "正品", "折扣", "ＳＡＬＥ", "１００％",
           "低价"]
SPAM = ["cheap", "best", "buy", "online", "discount", "free", "shipping", "deal", "sale", "offer", "now"]


def _noise(kind: str, rng: random.Random, valid: list[dict], foreign: dict[str, list[str]]) -> dict[str, Any]:
    rec: dict[str, Any] = {"valid": False, "kind": kind}
    if kind == "exact_dup":
        src = rng.choice(valid)
        return rec | {"text": src["text"], "dup_of": src["id"], "jaccard": 1.0, "source": src["source"]}
    if kind == "near_dup":
        src = rng.choice(valid)
        text, j = _near_dup(rng, src["text"], rng.uniform(0.75, 0.95))
        return rec | {"text": text, "dup_of": src["id"], "jaccard": round(j, 4), "source": src["source"]}
    if kind == "boilerplate":
        lines = [rng.choice(BOILERPLATE) for _ in range(rng.randint(15, 40))]
    elif kind == "navigation":
        lines = [" | ".join(rng.sample(NAV, rng.randint(4, 8))) for _ in range(rng.randint(10, 30))]
    elif kind == "minified_code":
        parts = [f"var {chr(97 + rng.randrange(26))}{i}=function(t,e){{return t.{rng.choice(['map', 'filter'])}"
                 f"(function(n){{return n*{rng.randint(2, 99)}+e}})}};" for i in range(rng.randint(30, 90))]
        lines = ["".join(parts)]
    elif kind == "base64":
        blob = base64.b64encode(rng.randbytes(rng.randint(600, 3000))).decode()
        lines = [blob[i:i + 76] for i in range(0, len(blob), 76)]
    elif kind == "log":
        lines = [f"2024-0{rng.randint(1, 9)}-{rng.randint(10, 28)} {rng.randint(10, 23)}:{rng.randint(10, 59)}:"
                 f"{rng.randint(10, 59)},{rng.randint(100, 999)} {rng.choice(['INFO', 'WARN', 'ERROR', 'DEBUG'])} "
                 f"[worker-{rng.randint(1, 16)}] {rng.choice(['conn', 'cache', 'sched', 'io'])}: "
                 f"{rng.choice(['retry', 'timeout', 'ok', 'evicted', 'flushed'])} id={rng.randint(1000, 99999)} "
                 f"latency={rng.randint(1, 900)}ms" for _ in range(rng.randint(20, 60))]
    elif kind == "mojibake":
        src = rng.choice(valid)["text"].replace("'", "\u2019").replace('"', "\u201c").replace(" - ", " \u2013 ")
        words = src.split(" ")
        for i in range(0, len(words), 7):
            words[i] = words[i] + "\u00e9"
        text = " ".join(words)
        for _ in range(2):  # twice: one round of repair cannot undo it
            text = text.encode("utf-8").decode("cp1252", errors="replace")
        return rec | {"text": text, "source": "generated"}
    elif kind == "zh_mojibake":  # UTF-8 Chinese read as GBK or Big5, undecodable bytes dropped: no repair
        zh = [r for r in valid if r.get("kind") == "zh_document"] or valid
        codec = rng.choice(["gbk", "big5"])
        return rec | {"text": rng.choice(zh)["text"].encode("utf-8").decode(codec, errors="ignore"),
                      "source": "generated"}
    elif kind == "zh_spam":
        lines = ["！".join(rng.choice(ZH_SPAM) for _ in range(rng.randint(6, 12))) for _ in range(rng.randint(10, 30))]
    elif kind == "wrong_language":
        lang = rng.choice(sorted(foreign))
        pool = foreign[lang]
        return rec | {"text": " ".join(rng.sample(pool, min(len(pool), rng.randint(10, 20)))), "lang": lang,
                      "source": f"locale:{lang}"}
    elif kind == "too_short":
        words = rng.choice(valid)["text"].split()
        start = rng.randrange(max(1, len(words) - 20))
        lines = [" ".join(words[start:start + rng.randint(3, 25)])]
    else:  # keyword_spam
        lines = [" ".join(rng.choice(SPAM) for _ in range(rng.randint(8, 15))) for _ in range(rng.randint(10, 30))]
    return rec | {"text": "\n".join(lines), "source": "generated"}


def build_corpus(seed: int = 0, valid_share: float = 0.68, split: str = "tune", max_valid: int | None = None,
                 ) -> list[dict[str, Any]]:
    """The labeled corpus of one split: sources are divided in two halves by a hash of their name ('tune' and
    'heldout'), so that thresholds tuned on one are reported on documents they never saw."""
    if split not in ("tune", "heldout", "all"):
        raise ValueError(f"split must be tune, heldout or all, not {split!r}")
    rng = random.Random(seed)

    def in_split(src: str) -> bool:
        half = hashlib.sha256(src.encode()).digest()[0] % 2
        return split == "all" or half == (0 if split == "tune" else 1)

    plain = _unique([d for d in [*python_docstrings(), *debian_docs()] if in_split(d[0])])
    rng.shuffle(plain)
    plain = plain[:max_valid] if max_valid else plain
    lic = [d for d in licenses() if in_split(d[0])]
    zh = [d for d in chinese_docs() if in_split(d[0])]
    sents = _sentences([t for _, t in plain])
    valid = [{"text": t, "valid": True, "kind": "document", "source": s} for s, t in plain]
    wide = set(rng.sample(range(len(zh)), len(zh) // 4))  # a quarter typed with full-width letters and digits
    valid += [{"text": to_fullwidth(t) if i in wide else t, "valid": True, "source": s, "lang": "zh",
               "kind": "zh_fullwidth" if i in wide else "zh_document"} for i, (s, t) in enumerate(zh)]
    valid += [{"text": t, "valid": True, "kind": "license", "source": s} for s, t in lic]
    n_hard = max(2, len(valid) // 20)
    valid += [{"text": _clauses(rng, sents), "valid": True, "kind": "clauses", "source": "generated"}
              for _ in range(n_hard)]
    valid += [{"text": _table(rng, sents), "valid": True, "kind": "table", "source": "generated"}
              for _ in range(n_hard)]
    for i, rec in enumerate(valid):
        rec["id"] = f"{split}-{seed}-v{i:05d}"
    foreign = foreign_sentences()
    kinds = [k for k in NOISE_KINDS if (k != "wrong_language" or foreign) and (not k.startswith("zh_") or zh)]
    n_noise = round(len(valid) * (1 - valid_share) / valid_share)
    noise = []
    for i in range(n_noise):
        rec = _noise(kinds[i % len(kinds)], rng, valid, foreign)
        rec["id"] = f"{split}-{seed}-n{i:05d}"
        noise.append(rec)
    corpus = valid + noise
    rng.shuffle(corpus)
    # a duplicate's original must come first for "keep the first" dedup to be judged fairly
    order = {r["id"]: i for i, r in enumerate(corpus)}
    corpus.sort(key=lambda r: order[r["dup_of"]] + 0.5 if "dup_of" in r and order[r["dup_of"]] > order[r["id"]]
                else order[r["id"]])
    return corpus


def _ric(rng: random.Random, valid: bool = True) -> str:
    from stdnum.cn import ric

    body = (f"{rng.choice(['110105', '310104', '440305', '510107', '330106'])}{rng.randint(1950, 2005)}"
            f"{rng.randint(1, 12):02d}{rng.randint(1, 28):02d}{rng.randint(0, 999):03d}")
    check = ric.calc_check_digit(body + "0")  # stdnum expects a placeholder check digit
    return body + (check if valid else next(c for c in "0123456789X" if c != check))


def _card(rng: random.Random, valid: bool = True, grouped: bool = False) -> str:
    from stdnum import luhn

    prefix, length = rng.choice([("62", 16), ("62", 19), ("4", 16), ("5", 16)])
    body = prefix + "".join(str(rng.randrange(10)) for _ in range(length - len(prefix) - 1))
    check = luhn.calc_check_digit(body)
    number = body + (check if valid else str((int(check) + 1) % 10))
    return " ".join(number[i:i + 4] for i in range(0, len(number), 4)) if grouped else number


def _mobile(rng: random.Random) -> str:
    d = f"1{rng.choice('3456789')}{rng.randrange(10)}{rng.randrange(10**8):08d}"
    return rng.choice([d, f"{d[:3]}-{d[3:7]}-{d[7:]}", f"+86 {d[:3]} {d[3:7]} {d[7:]}"])


PII_TEMPLATES = {
    "CN_RESIDENT_ID": ["Applicant ID number: {v}. Please verify it.", "客户的身份证号码是{v}，请核对。"],
    "BANK_CARD": ["Refund to card {v} within five days.", "退款将打入银行卡{v}。"],
    "EMAIL_ADDRESS": ["Send the report to {v} before Friday.", "请发邮件到{v}联系我们。"],
    "PHONE": ["Call me at {v} after six.", "我的手机号是{v}，有事请打。"],
    "IP_ADDRESS": ["The request came from {v} at noon.", "登录地址为{v}，请检查。"],
}
LOOKALIKES = ["Order number {ric_bad} was shipped.", "订单号{ric_bad}已发货。", "Tracking code {card_bad}.",
              "See section {ver} of the manual, version {ver}.", "ISBN 978-3-16-148410-0, printed 2019-04-12.",
              "The table lists 1024 2048 4096 8192 bytes and 12.5% growth.", "Invoice {digits16} is paid.",
              "Release v{ver} fixes clause 4.2.1 and 3.1.4.", "价格为12345.67元，编号2024-0001-3344。"]


def build_pii_corpus(seed: int = 0, per_type: int = 200) -> list[dict[str, Any]]:
    """Records with one planted PII value each (`planted`: {entity, value}) and look-alike hard negatives
    (`planted`: null): checksum-failing IDs and cards, version and section numbers, ISBNs, dates, tables."""
    rng = random.Random(seed)
    names = ["alice", "bob", "wang.wei", "li_na", "zhang3", "j.smith", "maria"]
    makers = {
        "CN_RESIDENT_ID": lambda: _ric(rng),
        "BANK_CARD": lambda: _card(rng, grouped=rng.random() < 0.5),
        "EMAIL_ADDRESS": lambda: f"{rng.choice(names)}{rng.randint(1, 999)}@"
                                 f"{rng.choice(['example.com', 'qq.com', '163.com', 'mail.org', 'corp.cn'])}",
        "PHONE": lambda: _mobile(rng) if rng.random() < 0.7 else
        f"({rng.choice(['212', '415', '617', '312'])}) {rng.randint(200, 999)}-{rng.randint(1000, 9999)}",
        "IP_ADDRESS": lambda: f"{rng.randint(11, 223)}.{rng.randint(0, 255)}.{rng.randint(0, 255)}."
                              f"{rng.randint(1, 254)}",
    }
    out = []
    for entity, make in makers.items():
        for _ in range(per_type):
            value = make()
            text = rng.choice(PII_TEMPLATES[entity]).format(v=value)
            out.append({"text": text, "planted": {"entity": entity, "value": value}})
    for _ in range(per_type * 2):
        text = rng.choice(LOOKALIKES).format(
            ric_bad=_ric(rng, valid=False), card_bad=_card(rng, valid=False),
            ver=".".join(str(rng.randint(0, 12)) for _ in range(rng.randint(3, 4))),
            digits16=f"{rng.randrange(10**16):016d}")
        out.append({"text": text, "planted": None})
    rng.shuffle(out)
    for i, rec in enumerate(out):
        rec["id"] = f"pii-{seed}-{i:05d}"
    return out
