"""Prices per model in integer micro-USD (no floats in money), with input-length tiers and a version.

    version = "2026-12-01"          # recorded on every ledger row
    [[model]]
    name = "glm-5"                  # the model id clients send; "*" prices every model not listed
    [[model.tier]]                  # tiers by prompt length; the prompt's tier prices the whole request
    max_prompt_tokens = 32768       # this tier holds prompts of at most this many tokens (omit on the last)
    input = "1.00"                  # USD per 1M uncached prompt tokens
    cached_input = "0.20"           # USD per 1M prompt tokens served from the prefix cache
    output = "3.20"                 # USD per 1M completion tokens
    [[model.tier]]
    input = "2.00"
    cached_input = "0.40"
    output = "6.40"

A request's cost is sum(tokens * micro-USD per 1M tokens), rounded half up to whole micro-USD once per request,
so a request costs the same streamed or not. Without a price file (or for a model the table does not price)
the cost is 0 and the tokens are still recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

import tomllib

from glmserve.errors import InvalidRequestError

PER_MILLION = 1_000_000
UNPRICED_VERSION = "unpriced"


class PriceFileError(InvalidRequestError):
    """The price file cannot be read or holds an invalid entry."""


@dataclass(frozen=True)
class Tier:
    max_prompt_tokens: int | None  # None: no upper bound
    input_micro: int  # micro-USD per 1M tokens
    cached_input_micro: int
    output_micro: int


@dataclass(frozen=True)
class Cost:
    cost_micro: int  # what the request is billed
    list_micro: int  # the same tokens with cached input priced as plain input (the saving is the difference)

    @property
    def saving_micro(self) -> int:
        return self.list_micro - self.cost_micro


def _round_per_million(total: int) -> int:
    return (total + PER_MILLION // 2) // PER_MILLION


def _micro(value: object, where: str) -> int:
    try:
        usd = Decimal(str(value))
    except InvalidOperation:
        raise PriceFileError(f"{where}: not a number: {value!r}") from None
    micro = usd * PER_MILLION
    if usd < 0 or micro != micro.to_integral_value():
        raise PriceFileError(f"{where}: prices must be >= 0 with at most 6 decimals, got {value!r}")
    return int(micro)


class PriceTable:
    """Tiers per model id; `cost` prices one request's usage."""

    def __init__(self, models: dict[str, list[Tier]], version: str) -> None:
        self.models = models
        self.version = version

    @classmethod
    def empty(cls) -> PriceTable:
        return cls({}, UNPRICED_VERSION)

    @classmethod
    def load(cls, path: str | Path) -> PriceTable:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise PriceFileError(f"cannot read the price file {path}: {exc}") from exc
        return cls.load_text(text, str(path))

    @classmethod
    def load_text(cls, text: str, path: str = "<prices>") -> PriceTable:
        try:
            data = tomllib.loads(text, parse_float=Decimal)
        except tomllib.TOMLDecodeError as exc:
            raise PriceFileError(f"cannot parse the price file {path}: {exc}") from exc
        version = data.get("version")
        if not isinstance(version, str) or not version:
            raise PriceFileError(f"{path}: needs a `version` string (recorded on every ledger row)")
        models: dict[str, list[Tier]] = {}
        for entry in data.get("model", []):
            name = entry.get("name")
            if not isinstance(name, str) or not name or name in models:
                raise PriceFileError(f"{path}: each [[model]] needs a unique `name`")
            models[name] = cls._tiers(entry.get("tier", []), f"{path}: model {name!r}")
        return cls(models, version)

    @staticmethod
    def _tiers(entries: list[dict], where: str) -> list[Tier]:
        if not entries:
            raise PriceFileError(f"{where}: needs at least one [[model.tier]]")
        tiers = []
        for i, t in enumerate(entries):
            bound = t.get("max_prompt_tokens")
            last = i == len(entries) - 1
            if (bound is None) != last or (bound is not None and (not isinstance(bound, int) or bound < 1)):
                raise PriceFileError(f"{where}: every tier but the last needs a positive `max_prompt_tokens`, "
                                     "the last none")
            if tiers and bound is not None and bound <= (tiers[-1].max_prompt_tokens or 0):
                raise PriceFileError(f"{where}: tiers must be in increasing max_prompt_tokens")
            try:
                tiers.append(Tier(bound, _micro(t["input"], where), _micro(t.get("cached_input", t["input"]), where),
                                  _micro(t["output"], where)))
            except KeyError as exc:
                raise PriceFileError(f"{where}: tier {i + 1} needs `{exc.args[0]}`") from None
        return tiers

    def tier(self, model: str, prompt_tokens: int) -> Tier | None:
        tiers = self.models.get(model) or self.models.get("*")
        if tiers is None:
            return None
        return next(t for t in tiers if t.max_prompt_tokens is None or prompt_tokens <= t.max_prompt_tokens)

    def cost(self, model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> Cost:
        tier = self.tier(model, prompt_tokens)
        if tier is None:
            return Cost(0, 0)
        cached = min(cached_tokens, prompt_tokens)
        out = completion_tokens * tier.output_micro
        billed = (prompt_tokens - cached) * tier.input_micro + cached * tier.cached_input_micro + out
        listed = prompt_tokens * tier.input_micro + out
        return Cost(_round_per_million(billed), _round_per_million(listed))


def format_usd(micro: int) -> str:
    """Micro-USD as a decimal string (exact)."""
    sign = "-" if micro < 0 else ""
    whole, frac = divmod(abs(micro), PER_MILLION)
    return f"{sign}{whole}.{frac:06d}"
