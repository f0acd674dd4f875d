"""Offline corpora and template questions for bench/bench_compress.py.

Documents come from Debian packages (`apt-get download` + `dpkg-deb -x` into $GLMSERVE_CACHE_DIR/bench/deb/,
not committed) and from files already installed on the machine:
- Debian Policy 4.6.2.0 (`debian-policy`, policy.txt, ~120K SmolLM2 tokens), English;
- the Debian New Maintainers' Guide in Simplified Chinese (`maint-guide-zh-cn`, maint-guide.zh-cn.txt: Debian's
  packaging rules, numbered chapters and sections), Chinese;
- the license texts Debian ships in /usr/share/common-licenses (package base-files), for the multi-document
  variants (the gold license first, in the middle or last of five);
- a code-routing corpus: code files of installed packages in several languages against prose (licenses,
  copyright files), policy text and Markdown with code blocks.

Questions (seeded): cloze (a number, a dotted section number or a quoted term of one sentence blanked; the answer
is that exact span) and "which section says X" (the sentence with a third of its words dropped; the answer is the
section label its span cites).
"""

from __future__ import annotations

import gzip
import random
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glmserve.compress.segment import Unit  # noqa: E402
from glmserve.paths import cache_dir  # noqa: E402

_ANSWER = re.compile(r"\b\d+(?:\.\d+)+\b|\b\d{2,}\b|\"[^\"\n]{2,30}\"|“[^”\n]{2,20}”")
LICENSES = Path("/usr/share/common-licenses")


@dataclass(frozen=True)
class Question:
    doc: str
    type: str  # "cloze" or "section"
    query: str  # what the compressor and the retrievers see
    prompt: str  # the question line of the model metric, before "Answer:"
    gold: tuple[int, int]  # the gold sentence's source span in `doc`
    answer: tuple[int, int]  # cloze: the blanked span; section: the gold sentence (it must be kept)
    answer_text: str  # what the model metric scores: the blanked span, or the section label


def deb_file(package: str, member: str) -> str:
    """One (gzipped) text file of a Debian package, downloaded once into the cache."""
    root = cache_dir() / "bench" / "deb" / package
    path = root / member
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["apt-get", "download", package], cwd=tmp, check=True, timeout=300)
            deb = next(Path(tmp).glob(f"{package}_*.deb"))
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True, timeout=300)
    data = path.read_bytes()
    return (gzip.decompress(data) if member.endswith(".gz") else data).decode("utf-8")


def debian_policy() -> str:
    return deb_file("debian-policy", "usr/share/doc/debian-policy/policy.txt.gz")


def maint_guide_zh() -> str:
    return deb_file("maint-guide-zh-cn", "usr/share/doc/maint-guide-zh-cn/maint-guide.zh-cn.txt.gz")


def license_text(name: str) -> str:
    return (LICENSES / name).read_text(encoding="utf-8")


def license_family(name: str) -> str:
    """"GPL-2" -> "GPL": versions of one license share much of their text, so they are kept apart."""
    return name.split("-")[0]


def license_distractors(gold: str, pool: tuple[str, ...], k: int, seed: int) -> list[str]:
    """`k` licenses of `pool` from other families than `gold`'s (a seeded draw, in draw order)."""
    others = [n for n in pool if license_family(n) != license_family(gold)]
    if len(others) < k:
        raise ValueError(f"only {len(others)} licenses of other families than {gold!r} in the pool, need {k}")
    return random.Random(f"{seed}:{gold}").sample(others, k)


def make_questions(units: list[Unit], n: int, chinese: bool = False, seed: int = 0) -> list[Question]:
    """`n` questions over one document's units, alternating cloze and "which section"."""
    lo, hi = (25, 200) if chinese else (60, 400)
    pool = [u for u in units if not u.heading and lo <= len(u.text) <= hi]
    rng = random.Random(seed)
    rng.shuffle(pool)
    out: list[Question] = []
    for u in pool:
        if len(out) >= n:
            break
        flat = " ".join(u.text.split())
        if len(out) % 2 == 0:
            m = _ANSWER.search(u.text)
            if not m:
                continue
            query = " ".join((u.text[:m.start()] + "____" + u.text[m.end():]).split())
            prompt = ("填空：" if chinese else "Fill in the blank: ") + query
            out.append(Question(u.doc, "cloze", query, prompt, (u.start, u.end),
                                (u.start + m.start(), u.start + m.end()), m.group(0)))
        else:
            if not re.fullmatch(r"\d+(?:\.\d+)*", u.section):
                continue
            words = flat.split() if not chinese else list(flat)
            kept = [w for w in words if rng.random() > 1 / 3]
            body = ("" if chinese else " ").join(kept)
            query = f"哪一节说：{body}？" if chinese else f"Which section says: {body}?"
            out.append(Question(u.doc, "section", query, query, (u.start, u.end), (u.start, u.end), u.section))
    return out


# ---------------------------------------------------------------------- code routing corpus

SITE = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
CODE_GLOBS = {  # language: (root, glob)
    "python": [(SITE, "**/*.py")],
    "c/c++": [(Path("/usr/include"), "**/*.h"), (SITE, "torch/include/**/*.h"), (SITE, "**/*.cpp")],
    "perl": [(Path("/usr/share/perl5"), "**/*.pm")],
    "shell": [(Path("/usr/share"), "**/*.sh"), (SITE, "**/*.sh")],
    "javascript": [(SITE, "**/*.js"), (Path("/usr/share"), "**/*.js")],
    "python stubs": [(SITE, "**/*.pyi")],
    "cython": [(SITE, "**/*.pyx"), (SITE, "**/*.pxd")],
}
PROSE_GLOBS = {
    "licenses and copyright files": [(LICENSES, "*"), (Path("/usr/share/doc"), "*/copyright")],
    "markdown with code blocks": [(SITE, "**/*.md"), (Path("/usr/share/doc"), "**/*.md")],
}


def _sample(globs: list[tuple[Path, str]], per_kind: int, rng: random.Random, need_fence: bool) -> list[str]:
    paths = sorted({p for root, pattern in globs if root.exists() for p in root.glob(pattern)
                    if p.is_file() and not p.is_symlink() and 300 <= p.stat().st_size <= 200_000})
    rng.shuffle(paths)
    texts: list[str] = []
    for p in paths:
        if len(texts) >= per_kind:
            break
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if need_fence and "```" not in text:
            continue
        texts.append(text)
    return texts


def routing_corpus(per_kind: int = 150, seed: int = 0) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(code texts by language, prose texts by kind), at most `per_kind` files each, sampled with `seed`."""
    rng = random.Random(seed)
    code = {lang: _sample(g, per_kind, rng, False) for lang, g in CODE_GLOBS.items()}
    prose = {kind: _sample(g, per_kind, rng, kind.startswith("markdown")) for kind, g in PROSE_GLOBS.items()}
    return {k: v for k, v in code.items() if v}, {k: v for k, v in prose.items() if v}
