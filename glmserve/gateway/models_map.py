"""The model-ID adapter: a table (TOML or JSON) maps the ids clients send (router and provider aliases such as
`openai/glm-4.5` or `glm-4.5-air@zhipu`) to the canonical model the backends serve and the pool of backends
that serve it. Requests go upstream with the canonical id; answers echo the id the client sent.

    [pools]                       # optional; a model without `pool` goes to every --backend
    air = ["http://10.0.0.5:8000"]

    [models."openai/glm-4.5"]
    model = "glm-4.5"
    [models."glm-4.5-air@zhipu"]
    model = "glm-4.5-air"
    pool = "air"
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmserve.errors import InvalidRequestError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class ModelRoute:
    external: str
    canonical: str
    pool: str | None  # None: the default pool (every --backend)


@dataclass(frozen=True)
class ModelMap:
    routes: dict[str, ModelRoute]
    pools: dict[str, tuple[str, ...]]

    @classmethod
    def empty(cls) -> ModelMap:
        return cls({}, {})

    @classmethod
    def load(cls, path: str | Path) -> ModelMap:
        path = Path(path)
        try:
            text = path.read_text()
            data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except (OSError, ValueError) as exc:  # JSONDecodeError and TOMLDecodeError are ValueErrors
            raise InvalidRequestError(f"--models {path}: {exc}") from exc
        return cls.parse(data, str(path))

    @classmethod
    def parse(cls, data: Any, where: str = "--models") -> ModelMap:
        if not isinstance(data, dict) or not isinstance(data.get("models"), dict) or not data["models"]:
            raise InvalidRequestError(f"{where}: needs a non-empty [models] table of external id -> "
                                      "{{model = CANONICAL, pool = NAME}}")
        pools_in = data.get("pools", {})
        if not isinstance(pools_in, dict):
            raise InvalidRequestError(f"{where}: [pools] must map a name to a list of backend URLs")
        pools: dict[str, tuple[str, ...]] = {}
        for name, urls in pools_in.items():
            if not isinstance(urls, list) or not urls or not all(isinstance(u, str) and u.startswith(("http://",
                                                                                                     "https://"))
                                                                  for u in urls):
                raise InvalidRequestError(f"{where}: pool {name!r} must be a non-empty list of http(s) URLs")
            pools[name] = tuple(u.rstrip("/") for u in urls)
        routes: dict[str, ModelRoute] = {}
        for external, entry in data["models"].items():
            if isinstance(entry, str):
                entry = {"model": entry}
            if not isinstance(entry, dict) or not isinstance(entry.get("model"), str) or not entry["model"]:
                raise InvalidRequestError(f"{where}: models.{external!r} needs `model = \"CANONICAL\"`")
            unknown = set(entry) - {"model", "pool"}
            if unknown:
                raise InvalidRequestError(f"{where}: models.{external!r} has unknown keys {sorted(unknown)}")
            pool = entry.get("pool")
            if pool is not None and pool not in pools:
                raise InvalidRequestError(f"{where}: models.{external!r} names pool {pool!r}, not in [pools] "
                                          f"({sorted(pools) or 'none'})")
            routes[external] = ModelRoute(external, entry["model"], pool)
        return cls(routes, pools)

    def resolve(self, model_id: str) -> ModelRoute | None:
        return self.routes.get(model_id)

    def model_list(self) -> dict[str, Any]:
        """`/v1/models` in OpenAI's shape: the external ids, each with its canonical model as `root`."""
        return {"object": "list", "data": [{"id": r.external, "object": "model", "created": 0,
                                            "owned_by": "glmserve-gateway", "root": r.canonical}
                                           for r in self.routes.values()]}
