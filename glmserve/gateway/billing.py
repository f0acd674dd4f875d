"""`glmserve billing report`: the ledger's sums per key and model, with the cost with and without the
cached-input discount and the saving, as a plain-text table (or JSON)."""

from __future__ import annotations

import json
from datetime import datetime, timezone

from glmserve.errors import InvalidRequestError
from glmserve.gateway.ledger import Ledger, UsageSummary
from glmserve.gateway.prices import format_usd

COLUMNS = ("key", "model", "requests", "prompt", "cached", "completion", "cost_usd", "without_cache_usd",
           "saving_usd", "saving_pct")


def since_ms(text: str | None) -> int:
    """Unix ms of a YYYY-MM-DD (UTC) date or an ISO date-time; 0 for None."""
    if not text:
        return 0
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidRequestError(f"--since expects a date (YYYY-MM-DD) or an ISO date-time, got {text!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1000)


def _row(s: UsageSummary) -> tuple[str, ...]:
    pct = f"{100 * s.saving_micro / s.list_cost_micro:.1f}%" if s.list_cost_micro else "-"
    return (s.key_name, s.model, str(s.requests), str(s.prompt_tokens), str(s.cached_tokens),
            str(s.completion_tokens), format_usd(s.cost_micro), format_usd(s.list_cost_micro),
            format_usd(s.saving_micro), pct)


def _total(sums: list[UsageSummary]) -> UsageSummary:
    return UsageSummary("TOTAL", "", *(sum(getattr(s, f) for s in sums) for f in (
        "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_micro", "list_cost_micro")))


def report(ledger_url: str | None, since: str | None = None, key: str | None = None, as_json: bool = False) -> str:
    ledger = Ledger(ledger_url)
    try:
        sums = ledger.summary(since_ms(since), key)
    finally:
        ledger.close()
    rows = [_row(s) for s in sums] + [_row(_total(sums))]
    if as_json:
        return json.dumps([dict(zip(COLUMNS, r)) for r in rows], indent=2)
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths))]
    lines += ["  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
              for r in rows]
    return "\n".join(lines)
