"""Policy-term spelling against a glossary of canonical terms (rule-based).

A glossary file has one canonical term a line, optionally with its known variants:
`Data Controller = controller of data; data-controller` (`#` starts a comment). In the draft, a word
sequence that is the term written otherwise is flagged: a listed variant, another case, spacing or
hyphenation ("e-mail" for "email", "data controller" for "Data Controller"; a lower-case term may start
with a capital), or a one-letter slip in a term of 6+ letters ("Licencee" for "Licensee"; two slips from
10 letters) that keeps the term's first and last letters. Plurals and possessives of the term are fine.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from glmserve.compress.drafting.cite import Finding, Locator
from glmserve.errors import InvalidRequestError

_WORD = re.compile(r"[^\W_](?:[\w'’]*[^\W_])?")
_GAP = re.compile(r"\s*-?\s*")
_KEY = re.compile(r"[\W_]+")


@dataclass(frozen=True)
class Term:
    canonical: str
    variants: tuple[str, ...] = ()


def load_glossary(path: str | Path) -> list[Term]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read glossary {path}: {exc}") from exc
    return parse_glossary(lines, str(path))


def parse_glossary(lines: list[str], name: str = "glossary") -> list[Term]:
    terms = []
    for n, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        canonical, _, rest = line.partition("=")
        canonical = canonical.strip()
        if not _WORD.search(canonical):
            raise InvalidRequestError(f"{name}:{n}: a glossary term needs a word, got {raw!r}")
        variants = tuple(v.strip() for v in rest.split(";") if v.strip())
        terms.append(Term(canonical, variants))
    if not terms:
        raise InvalidRequestError(f"{name}: the glossary holds no term")
    return terms


def key(s: str) -> str:
    return _KEY.sub("", s.lower())


def osa_distance(a: str, b: str, limit: int) -> int:
    """Optimal string alignment distance (Levenshtein plus adjacent swaps), or limit + 1 once it exceeds limit."""
    if abs(len(a) - len(b)) > limit:
        return limit + 1
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        if min(cur) > limit:
            return limit + 1
        prev2, prev = prev, cur
    return prev[-1]


def _allowed_form(surface: str, canonical: str) -> bool:
    if surface == canonical:
        return True
    # a lower-case term may open a sentence or a title with a capital
    return canonical[:1].islower() and surface[:1].isupper() and surface[:1].lower() + surface[1:] == canonical


def check_glossary(loc: Locator, terms: list[Term]) -> list[Finding]:
    text, out = loc.text, []
    words = list(_WORD.finditer(text))
    by_key = {key(t.canonical): t for t in terms}
    variant_of = {v.lower(): t for t in terms for v in t.variants}
    fuzzy: dict[tuple[str, str], list[tuple[str, Term]]] = defaultdict(list)
    for k, t in by_key.items():
        if len(k) >= 6:
            fuzzy[(k[0], k[-1])].append((k, t))
    longest = max(len(_WORD.findall(x)) for t in terms for x in (t.canonical, *t.variants)) + 1
    taken = [False] * len(words)
    for n in range(longest, 0, -1):  # the longest match wins
        for i in range(len(words) - n + 1):
            if any(taken[i:i + n]) or not all(
                    _GAP.fullmatch(text, words[j].end(), words[j + 1].start()) for j in range(i, i + n - 1)):
                continue
            a, b = words[i].start(), words[i + n - 1].end()
            surface = text[a:b]
            found = _match(surface, variant_of, by_key, fuzzy)
            if found is None:
                continue
            term, kind = found
            taken[i:i + n] = [True] * n
            if kind is None:
                continue
            message = (f'"{surface}" is a misspelling of "{term.canonical}"' if kind == "term_misspelling"
                       else f'"{surface}": the glossary spells it "{term.canonical}"')
            out.append(loc.finding(kind, message, a, b))
    return out


def _match(surface: str, variant_of: dict[str, Term], by_key: dict[str, Term],
           fuzzy: dict[tuple[str, str], list[tuple[str, Term]]]) -> tuple[Term, str | None] | None:
    """(term, finding kind or None when the form is fine), or None when the words are no glossary term."""
    k = key(surface)
    if not k:
        return None
    term = variant_of.get(surface.lower()) or by_key.get(k)
    if term is not None:
        return term, None if _allowed_form(surface, term.canonical) else "term_variant"
    for stem in _stems(k):  # plurals and possessives
        if stem in by_key:
            return by_key[stem], None
    if len(k) < 6:
        return None
    for t_key, t in fuzzy.get((k[0], k[-1]), ()):
        limit = 2 if len(t_key) >= 10 else 1
        if osa_distance(k, t_key, limit) <= limit:
            return t, "term_misspelling"
    return None


def _stems(k: str) -> list[str]:
    out = [k[:-1]] if k.endswith("s") else []
    if k.endswith("es"):
        out.append(k[:-2])
    if k.endswith("ies"):
        out.append(k[:-3] + "y")
    return out
