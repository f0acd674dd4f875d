"""Drafting assistant (issue 17, the seeds' section 4): multi-turn drafting of a document against a running
`glmserve serve`, through the official `openai` client, with the server's session KV and consistency checks.

    glmserve serve --port 8000 &
    .venv/bin/python examples/drafting_assistant.py --base-url http://127.0.0.1:8000/v1 --brief BRIEF.txt \
        [--draft START.txt] [--glossary GLOSSARY.txt] [--session-id ID] [--summary] [--out DRAFT.txt] [--json]

Each line of BRIEF is one turn: the instruction for the next part of the document. Every turn belongs to one
session (`session_id` in the request body; the `X-Session-Id` header works too), so the server keeps the
conversation's KV between turns and turn 2+ report `usage.prompt_tokens_details.cached_tokens`; with
`--summary` a conversation that outgrows the server's `--session-summary-threshold` is anchored on its
state summary (glmserve/server/anchoring.py) instead of growing without end. The draft is the starting text
plus each turn's reply; after every turn the rule-based checks (glmserve/compress/drafting: time logic,
referents defined before use, glossary spelling) run on it, and their findings, cited by section and
paragraph, are put in front of the next instruction for the model to fix.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glmserve.compress.drafting import Finding, Term, check_draft, load_glossary  # noqa: E402

SYSTEM = ("You are a careful drafting assistant. Write the requested part of the document in plain text, "
          "consistent with what is already drafted: dates in order, defined terms defined before use, and "
          "the glossary's spelling of every term.")
MAX_FINDINGS_SHOWN = 8  # findings listed in one instruction


@dataclass
class Turn:
    turn: int
    instruction: str
    reply: str
    prompt_tokens: int
    cached_tokens: int
    findings: list[dict] = field(default_factory=list)


def _findings_note(findings: list[Finding]) -> str:
    lines = [f"- {f.where()}: {f.message}" for f in findings[:MAX_FINDINGS_SHOWN]]
    more = len(findings) - MAX_FINDINGS_SHOWN
    if more > 0:
        lines.append(f"- ... and {more} more")
    return "Fix these consistency findings in the draft:\n" + "\n".join(lines)


def draft_document(client, model: str, instructions: list[str], draft: str = "",
                   glossary: list[Term] | None = None, session_id: str | None = None, max_tokens: int = 256,
                   summary: bool = False) -> tuple[str, list[Turn]]:
    """Runs the turns; returns the final draft and what each turn did."""
    session_id = session_id or f"draft-{uuid.uuid4().hex[:12]}"
    system = SYSTEM
    if glossary:
        system += "\nGlossary: " + "; ".join(t.canonical for t in glossary) + "."
    messages = [{"role": "system", "content": system}]
    turns: list[Turn] = []
    findings = check_draft(draft, "draft", glossary) if draft.strip() else []
    for n, instruction in enumerate(instructions, 1):
        parts = [f"The draft so far:\n\n{draft}"] if n == 1 and draft.strip() else []
        if findings:
            parts.append(_findings_note(findings))
        parts.append(instruction)
        messages.append({"role": "user", "content": "\n\n".join(parts)})
        extra = {"session_id": session_id} | ({"session_summary": True} if summary else {})
        response = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, extra_body=extra)
        reply = response.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": reply})
        draft = f"{draft}\n\n{reply.strip()}" if draft.strip() else reply.strip()
        findings = check_draft(draft, "draft", glossary)
        details = response.usage.prompt_tokens_details
        turns.append(Turn(n, instruction, reply, response.usage.prompt_tokens,
                          (details.cached_tokens or 0) if details else 0, [f.to_dict() for f in findings]))
    return draft, turns


def main(argv: list[str] | None = None) -> list[Turn]:
    import openai

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--brief", required=True, help="one instruction a line, one turn each")
    ap.add_argument("--draft", default=None, help="the starting draft")
    ap.add_argument("--glossary", default=None, help="canonical terms: 'Term' or 'Term = variant; variant' a line")
    ap.add_argument("--session-id", default=None)
    ap.add_argument("--summary", action="store_true", help="anchor long sessions on the server's state summary")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default=None, help="write the final draft here")
    ap.add_argument("--json", action="store_true", help="print the turns as JSON")
    args = ap.parse_args(argv)
    instructions = [line.strip() for line in Path(args.brief).read_text(encoding="utf-8").splitlines() if line.strip()]
    start = Path(args.draft).read_text(encoding="utf-8") if args.draft else ""
    glossary = load_glossary(args.glossary) if args.glossary else None
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=600)
    model = args.model or client.models.list().data[0].id
    draft, turns = draft_document(client, model, instructions, start, glossary, args.session_id, args.max_tokens,
                                  args.summary)
    if args.out:
        Path(args.out).write_text(draft, encoding="utf-8")
    if args.json:
        print(json.dumps([asdict(t) for t in turns], ensure_ascii=False, indent=1))
    else:
        for t in turns:
            print(f"turn {t.turn}: {t.prompt_tokens} prompt tokens, {t.cached_tokens} cached, "
                  f"{len(t.findings)} finding(s)")
            for f in t.findings:
                where = f"§{f['at']['section']} ¶{f['at']['paragraph']}"
                print(f"  [{f['check']}] {where} @{f['at']['start']}: {f['message']}")
    return turns


if __name__ == "__main__":
    main()
