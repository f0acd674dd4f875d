"""Model ids a client may ask for: the served model and its aliases.

Responses echo the id the client sent, so a router or provider name passed as an alias
comes back unchanged; an unknown id is a `model_not_found` error.
"""

from __future__ import annotations

from collections.abc import Mapping

from glmserve.errors import InvalidRequestError
from glmserve.server.errors import ModelNotFoundError


def check_aliases(served_model: str, aliases: Mapping[str, str]) -> None:
    """Every alias must name the served model as its canonical id."""
    unknown = {a: c for a, c in aliases.items() if c != served_model}
    if unknown:
        listed = ", ".join(f"{a}={c}" for a, c in unknown.items())
        raise InvalidRequestError(f"aliases must point to the served model {served_model!r}; these do not: {listed}")


class AliasTable:
    """Maps every accepted model id to the canonical served model id."""

    def __init__(self, served_model: str, aliases: Mapping[str, str]) -> None:
        check_aliases(served_model, aliases)
        self.served_model = served_model
        self._canonical = {served_model: served_model, **dict(aliases)}

    def resolve(self, requested: str | None) -> str:
        """Return the id to echo back; the served model when the client named none."""
        if requested is None:
            return self.served_model
        if requested not in self._canonical:
            raise ModelNotFoundError(requested)
        return requested

    def canonical(self, model_id: str) -> str:
        """Canonical id behind `model_id` (which must be known)."""
        if model_id not in self._canonical:
            raise ModelNotFoundError(model_id)
        return self._canonical[model_id]

    def ids(self) -> list[str]:
        """Every accepted id, served model first."""
        return list(self._canonical)
