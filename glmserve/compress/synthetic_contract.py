"""A seeded synthetic services agreement with planted facts and their gold answers (issue 17's contract review).

The contract has numbered articles and clauses (a clause is a heading line "7.2 Late Payment" followed by
paragraphs), definitions, cross-references, pages (form feeds, as pdftotext writes them) and filler narrative
drawn from templates that never state a rate, a guarantee, a liability limit, a termination right or the
governing law. Planted facts, each one sentence placed at a random paragraph of its clause: interest / late
payment rates above and below the cap, a guarantee, a limitation of liability, a termination notice period and
the governing law; a seed may leave out the guarantee, the liability limit or the termination clause, whose gold
answer is then "missing". Gold citations come from the compressor's own segmenter (glmserve/compress/locate.py),
so they use the same section / paragraph / page labels as the trace map.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from glmserve.compress.locate import Locator
from glmserve.errors import InvalidRequestError

CHARS_PER_TOKEN = 5.1  # filler prose in the embedded SmolLM2 tokenizer (measured on this generator's output)
RULE_NAMES = ("rate_cap", "guarantee", "liability", "termination", "governing_law")
OPTIONAL_RULES = ("guarantee", "liability", "termination")

_SUBJECTS = ("The Supplier", "The Customer", "Each Party", "The Project Manager", "The Steering Committee",
             "The Service Desk", "The Account Manager", "The Change Board", "The Security Officer",
             "The Supplier Personnel", "The Customer Representative", "The Delivery Team")
_VERBS = ("shall maintain", "shall provide", "shall document", "shall review", "may request", "shall update",
          "shall keep accurate records of", "shall promptly notify the other Party of", "shall agree",
          "shall make available", "shall prepare and circulate", "shall take reasonable steps to protect",
          "shall co-operate in good faith on", "shall test and approve", "shall report on")
_OBJECTS = ("the service reports", "the change control records", "the acceptance criteria", "the security plan",
            "the transition timetable", "the list of key personnel", "the disaster recovery procedures",
            "the asset register", "the quality plan", "the exit plan", "the risk register", "the release notes",
            "the capacity forecast", "the training material", "the incident log", "the data retention schedule",
            "the access control lists", "the monthly performance dashboard")
_TAILS = ("in accordance with Section {xref}", "within {n} Business Days of a written request",
          "at its own cost", "as described in Schedule {sched}", "before each quarterly review meeting",
          "unless the Parties agree otherwise in writing", "in the format set out in Section {xref}",
          "using the tools approved by the Steering Committee", "for the whole of the Term",
          "with the care of a diligent and experienced provider", "no later than the last Business Day of each month",
          "subject to the procedure in Section {xref}", "to the reasonable satisfaction of the Customer",
          "so that the Services meet the Service Levels", "in English and in electronic form")
_EXTRAS = ("Any disagreement on this point goes to the Steering Committee first.",
           "Meetings may take place by video conference.",
           "The Parties shall record the outcome in the minutes.",
           "Nothing in this clause limits the obligations in Section {xref}.",
           "Where a document is revised, the latest approved version applies.",
           "Costs of $ {amount} or less need no separate approval.",
           "The Customer may attend as an observer.")
_TOPICS = ("Services", "Service Levels", "Governance", "Change Control", "Personnel", "Subcontracting",
           "Security", "Data Protection", "Confidential Information", "Intellectual Property", "Audit",
           "Business Continuity", "Transition", "Exit Management", "Insurance", "Force Majeure", "Notices",
           "Assignment", "Records", "Reporting", "Acceptance", "Customer Obligations", "Compliance",
           "Relationship Management", "Continuous Improvement", "Documentation", "Training", "Facilities")
_CLAUSE_TITLES = ("General", "Scope", "Standards", "Procedure", "Records", "Review", "Reporting", "Escalation",
                  "Timetable", "Resources", "Approvals", "Variations", "Cooperation", "Costs", "Updates")
_DEFINED = (("Business Day", "a day other than a Saturday, Sunday or public holiday in the place of the Customer"),
            ("Charges", "the sums payable for the Services as set out in Schedule 2"),
            ("Control", "the power to direct the management of a company through a majority of its voting shares"),
            ("Deliverable", "any document, software or other item the Supplier provides under this Agreement"),
            ("Effective Date", "the date on which the last Party signs this Agreement"),
            ("Service Levels", "the performance standards described in Schedule 3"),
            ("Services", "the services described in Schedule 1 and in Article 3"),
            ("Term", "the period from the Effective Date until the end of this Agreement"))
_LAWS = ("England and Wales", "the State of New York", "Singapore", "Ireland", "the Netherlands")
_GUARANTORS = ("Northwind Holdings Limited", "Atlas Group plc", "Meridian Parent Inc.")
_MONTHLY = (2.5, 3.0, 4.0)  # percent a month: 30-48% a year, always above a cap of 24
_ANNUAL_LOW = (4.0, 6.5, 8.0, 12.0, 18.0)
_ANNUAL_HIGH = (28.0, 30.0, 36.0)


@dataclass(frozen=True)
class Fact:
    """One planted sentence: `text[start:end]`, cited as the segmenter cites it."""

    rule: str
    start: int
    end: int
    section: str
    paragraph: int
    page: int
    annual_rate: float | None = None  # rate facts: percent a year
    violation: bool = False  # rate facts: above the cap


@dataclass(frozen=True)
class Gold:
    """A rule's expected verdict ("ok", "violation" or "missing") and the facts a correct finding may cite."""

    status: str
    facts: tuple[Fact, ...]


@dataclass
class SyntheticContract:
    text: str
    rate_cap: float
    seed: int
    facts: list[Fact] = field(default_factory=list)
    omitted: tuple[str, ...] = ()

    def gold(self, rule: str) -> Gold:
        if rule not in RULE_NAMES:
            raise InvalidRequestError(f"unknown rule {rule!r}; known: {', '.join(RULE_NAMES)}")
        facts = tuple(f for f in self.facts if f.rule == rule)
        if rule == "rate_cap":
            high = tuple(f for f in facts if f.violation)
            return Gold("violation", high) if high else Gold("ok", facts)
        return Gold("ok", facts) if facts else Gold("missing", ())


class _Writer:
    """Accumulates the contract text; planted sentences are remembered by offset, cited at the end."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.parts: list[str] = []
        self.size = 0
        self.since_page = 0
        self.planted: list[tuple[str, int, int, float | None, bool]] = []
        self.labels: list[str] = []

    def add(self, piece: str) -> int:
        at = self.size
        self.parts.append(piece)
        self.size += len(piece)
        return at

    def paragraph(self, sentences: list[str]) -> int:
        """Writes one paragraph; returns the offset of its first sentence."""
        if self.since_page > 3500:  # a page break between paragraphs, as a PDF-to-text tool writes it
            self.add("\f")
            self.since_page = 0
        text = " ".join(sentences)
        self.since_page += len(text)
        return self.add(text + "\n\n")

    def filler(self) -> str:
        r = self.rng
        tail = r.choice(_TAILS).format(xref=r.choice(self.labels) if self.labels else "3.1",
                                       n=r.choice((5, 10, 15, 20)), sched=r.randint(1, 6))
        sentence = f"{r.choice(_SUBJECTS)} {r.choice(_VERBS)} {r.choice(_OBJECTS)} {tail}."
        if r.random() < 0.2:
            extra = r.choice(_EXTRAS).format(xref=r.choice(self.labels) if self.labels else "3.1",
                                             amount=f"{r.randint(1, 50) * 1000:,}")
            sentence += " " + extra
        return sentence


def generate(seed: int, target_tokens: int = 30_000, rate_cap: float = 24.0) -> SyntheticContract:
    """A contract of about `target_tokens` tokens (embedded SmolLM2 tokenizer) with its gold answers."""
    if target_tokens < 2_000:
        raise InvalidRequestError(f"target_tokens must be >= 2000 (room for the planted clauses), got {target_tokens}")
    rng = random.Random(seed)
    w = _Writer(rng)
    omitted = tuple(r for r in OPTIONAL_RULES if rng.random() < 0.35)
    violation = rng.random() < 0.5
    budget = int(target_tokens * CHARS_PER_TOKEN)

    w.add("MASTER SERVICES AGREEMENT\n\n")
    w.paragraph([f'This Master Services Agreement (the "Agreement") is made between Corvid Systems Ltd (the '
                 f'"Supplier") and Halden Retail Group Ltd (the "Customer") on {rng.randint(1, 28)} '
                 f'{rng.choice(("March", "June", "September"))} 2025.'])
    w.add("ARTICLE 1 DEFINITIONS\n\n")
    w.labels.append("1.1")
    w.add("1.1 Defined Terms\n\n")
    for term, meaning in _DEFINED:
        w.paragraph([f'"{term}" means {meaning}.'])

    # the planted clauses: (article topic, clause title, rule, sentence, annual rate, violation)
    low = rng.choice(_ANNUAL_LOW)
    planted: list[tuple[str, str, str, str, float | None, bool]] = [
        ("Charges and Payment", "Interest on Late Payment", "rate_cap",
         f"Any amount not paid when due bears interest at {low:g}% per annum from the due date until payment.",
         low, False)]
    if violation:
        if rng.random() < 0.5:
            m = rng.choice(_MONTHLY)
            planted.append(("Charges and Payment", "Late Payment Charge", "rate_cap",
                            f"A late payment charge of {m:g}% per month accrues on every overdue invoice.",
                            m * 12, True))
        else:
            high = rng.choice(_ANNUAL_HIGH)
            planted.append(("Charges and Payment", "Default Interest", "rate_cap",
                            f"Following an event of default, the outstanding balance bears interest at {high:g}% "
                            f"per annum.", high, True))
    if "guarantee" not in omitted:
        planted.append(("Parent Company Guarantee", "Guarantee", "guarantee",
                        f"{rng.choice(_GUARANTORS)} irrevocably and unconditionally guarantees to the Customer the "
                        f"due and punctual performance of every obligation of the Supplier under this Agreement.",
                        None, False))
    if "liability" not in omitted:
        planted.append(("Limitation of Liability", "Liability Cap", "liability",
                        "The total aggregate liability of the Supplier under or in connection with this Agreement "
                        "shall not exceed the Charges paid in the twelve months before the claim arose.", None, False))
    if "termination" not in omitted:
        planted.append(("Term and Termination", "Termination for Convenience", "termination",
                        f"Either Party may terminate this Agreement for convenience by giving the other Party not "
                        f"less than {rng.choice((30, 60, 90, 180))} days' written notice.", None, False))
    planted.append(("Governing Law", "Governing Law", "governing_law",
                    f"This Agreement and any dispute arising out of it shall be governed by the laws of "
                    f"{rng.choice(_LAWS)}.", None, False))

    # articles: filler topics, with the planted ones at random places; each filled until the budget is reached
    planted_topics = list(dict.fromkeys(p[0] for p in planted))
    # long clauses (~8K characters each) keep the headings, which compression never drops, to ~2-3% of the text
    n_articles = max(len(planted_topics) + 2, int(budget / 30_000))
    topics = [rng.choice(_TOPICS) for _ in range(n_articles - len(planted_topics))]
    for t in planted_topics:
        topics.insert(rng.randint(0, len(topics)), t)
    per_article = max(1, (budget - w.size) // len(topics))
    for a, topic in enumerate(topics, start=2):
        w.add(f"ARTICLE {a} {topic.upper()}\n\n")
        here = [p for p in planted if p[0] == topic]
        titles = rng.sample(_CLAUSE_TITLES, k=rng.randint(2, 5))
        n_clauses = max(len(titles), len(here) + 2)
        clause_titles = titles + [rng.choice(_CLAUSE_TITLES) for _ in range(n_clauses - len(titles))]
        spots = rng.sample(range(n_clauses), k=len(here))
        article_end = w.size + per_article
        for c in range(n_clauses):
            label = f"{a}.{c + 1}"
            fact = here[spots.index(c)] if c in spots else None
            w.add(f"{label} {fact[1] if fact else clause_titles[c]}\n\n")
            clause_end = w.size + max(600, (article_end - w.size) // (n_clauses - c))
            paragraphs = []
            while w.size + sum(len(" ".join(p)) for p in paragraphs) < clause_end or not paragraphs:
                paragraphs.append([w.filler() for _ in range(rng.randint(2, 4))])
            where = rng.randrange(len(paragraphs)) if fact else -1
            for i, sentences in enumerate(paragraphs):
                if i != where or fact is None:
                    w.paragraph(sentences)
                    continue
                pos = rng.randint(0, len(sentences))
                before = " ".join(sentences[:pos])
                start = w.paragraph(sentences[:pos] + [fact[3]] + sentences[pos:]) + (len(before) + 1 if before else 0)
                w.planted.append((fact[2], start, start + len(fact[3]), fact[4], fact[5]))
            w.labels.append(label)
    text = "".join(w.parts)
    loc = Locator("contract", text)
    facts = []
    for rule, start, end, rate, high in w.planted:
        c = loc.cite(start, end)
        facts.append(Fact(rule, start, end, c.section, c.paragraph, c.page, rate,
                          high if rate is None else rate > rate_cap))
    return SyntheticContract(text, rate_cap, seed, facts, omitted)
