"""Quantization recipes: which linear layer gets which scheme, read from a YAML or JSON file.

Two spellings are accepted.
  rules form:   {"rules": [{"pattern": "*.self_attn.*_proj", "scheme": "fp8"}, ...],
                 "default": "none", "activation_threshold": 6.0}
                patterns are shell globs over module names (`fnmatch`) or "re:<regex>"; the first match wins;
                "none" keeps a layer in float.
  seeds' form:  {"attention_layers": {"type": "fp8", "scheme": "E4M3"},
                 "ffn_layers": {"type": "nvfp4", "group_size": 128}, "activation_threshold": 6.0}
                (also nested under "quantization_config"). `attention_layers` covers every attention projection
                (q, k, v and o), `ffn_layers` every MLP projection (gate, up, down, fused or not).
NVFP4 is defined by its E4M3 scale per 16 values (compressed-tensors and vLLM accept no other group), so a seeds'
`group_size` other than 16 under `nvfp4` is noted and the format's 16 is used.

`rotate`: true (or a kind: auto, hadamard, random) rotates the residual stream before quantizing (rotate.py), as
`glmserve quantize --rotate` does.

`bits_budget` (bits per weight over the recipe's quantized layers) and `candidates` (scheme names, "none" for
float): the recipe's schemes become each layer unit's floor, and units are upgraded to candidates of more bits in the
order of their measured sensitivity until the budget is spent (pipeline.choose_schemes; the seeds' "differentiated
precision per layer" with its layer-wise sensitivity). Without `candidates` the upgrades are the recipe's own schemes
(the seeds' form: an NVFP4 FFN unit may become FP8); `sensitivity` (measured or fisher) how the units' loss increases
are found. `glmserve quantize --bits-budget / --candidates / --sensitivity` override the file.

`activation_threshold`: input channels whose activation absmax on the calibration text exceeds it (LLM.int8()'s
outlier features, Dettmers et al. 2022, arXiv 2208.07339, use 6.0) keep their weight columns in float; the rest of
the weight is quantized with those columns zeroed (quant/weight.py OutlierColumns; the engine runs them
natively, layers/linear.py).

Embeddings, norms and lm_head are never linear layers a rule can reach except by naming lm_head explicitly (no
glob wildcard matches it), so they stay in high precision unless asked.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from glmserve.errors import InvalidRequestError
from glmserve.quant.rotate import KINDS
from glmserve.quant.sensitivity import KINDS as SENSITIVITY_KINDS

NONE = "none"
LM_HEAD = "lm_head"
ATTENTION_PATTERNS = ("re:.*(self_attn|attention)\\.(q|k|v|o|qkv|query_key_value|dense)_proj$",)
FFN_PATTERNS = ("re:.*(mlp|feed_forward)\\.(gate|up|down|gate_up|fc1|fc2)_proj$",)
NVFP4_GROUP = 16
SEEDS_TYPES = {("fp8", "E4M3"): "fp8", ("fp8", None): "fp8", ("nvfp4", None): "nvfp4", ("int8", None): "int8",
               ("int4", None): "w4a16", ("w8a8", None): "w8a8"}


@dataclass(frozen=True)
class Rule:
    pattern: str
    scheme: str

    def matches(self, name: str) -> bool:
        if self.pattern.startswith("re:"):
            return re.match(self.pattern[3:], name) is not None
        if name == LM_HEAD or name.endswith("." + LM_HEAD):
            return self.pattern == name
        return fnmatch.fnmatchcase(name, self.pattern)


@dataclass(frozen=True)
class Recipe:
    rules: tuple[Rule, ...]
    default: str = NONE
    activation_threshold: float | None = None
    rotate: str | None = None  # a rotate.KINDS kind: rotate the residual stream first; None: no rotation
    notes: tuple[str, ...] = field(default=())  # what was read differently from the file's letter, for the user
    bits_budget: float | None = None  # upgrade units above their rule's scheme under this many bits per weight
    candidates: tuple[str, ...] = ()  # the upgrades a bits budget chooses from; (): the recipe's own schemes
    sensitivity: str | None = None  # a sensitivity.KINDS kind for the budget; None: the command's default

    def schemes(self) -> set[str]:
        """Every scheme the rules and the default name, "none" included."""
        return {r.scheme for r in self.rules} | {self.default}

    def scheme_for(self, name: str) -> str:
        for rule in self.rules:
            if rule.matches(name):
                return rule.scheme
        if name == LM_HEAD or name.endswith("." + LM_HEAD):
            return NONE
        return self.default

    def assign(self, linear_names: Iterable[str], known_schemes: Iterable[str]) -> dict[str, str]:
        """Module name -> scheme for every linear layer not left in float."""
        known = set(known_schemes) | {NONE}
        for scheme in self.schemes() | set(self.candidates):
            if scheme not in known:
                raise InvalidRequestError(f"recipe names unknown scheme {scheme!r} (known: {', '.join(sorted(known))})")
        out = {name: self.scheme_for(name) for name in linear_names}
        return {name: s for name, s in out.items() if s != NONE}


def uniform(scheme: str) -> Recipe:
    """Every linear layer but lm_head in `scheme`."""
    return Recipe(rules=(), default=scheme)


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise InvalidRequestError(f"recipe file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise InvalidRequestError(f"recipe {path} is not valid {path.suffix.lstrip('.') or 'YAML'}: {e}") from e
    return parse_recipe(data, str(path))


def parse_recipe(data: object, where: str = "recipe") -> Recipe:
    if not isinstance(data, Mapping):
        raise InvalidRequestError(f"{where}: a recipe is a mapping, got {type(data).__name__}")
    if "quantization_config" in data and isinstance(data["quantization_config"], Mapping):
        data = data["quantization_config"]
    threshold = data.get("activation_threshold")
    if threshold is not None and (not isinstance(threshold, (int, float)) or threshold <= 0):
        raise InvalidRequestError(f"{where}: activation_threshold must be a positive number, got {threshold!r}")
    threshold = None if threshold is None else float(threshold)
    rotate = data.get("rotate")
    if rotate is True:
        rotate = "auto"
    if rotate not in (None, False) and rotate not in KINDS:
        raise InvalidRequestError(f"{where}: rotate must be true, false or one of {', '.join(KINDS)}, got {rotate!r}")
    budget = data.get("bits_budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0):
        raise InvalidRequestError(f"{where}: bits_budget must be a positive number of bits per weight, got {budget!r}")
    candidates = data.get("candidates", [])
    if isinstance(candidates, str):
        candidates = [c.strip() for c in candidates.split(",") if c.strip()]
    if not isinstance(candidates, list) or not all(isinstance(c, str) for c in candidates):
        raise InvalidRequestError(f"{where}: candidates is a list of scheme names, got {candidates!r}")
    if candidates and budget is None:
        raise InvalidRequestError(f"{where}: candidates are the upgrades a bits_budget chooses from: give bits_budget")
    sensitivity = data.get("sensitivity")
    if sensitivity is not None and (budget is None or sensitivity not in SENSITIVITY_KINDS):
        raise InvalidRequestError(f"{where}: sensitivity is one of {', '.join(SENSITIVITY_KINDS)} and goes with a "
                                  f"bits_budget, got {sensitivity!r}")
    unknown = set(data) - {"rules", "default", "activation_threshold", "attention_layers", "ffn_layers", "rotate",
                           "bits_budget", "candidates", "sensitivity"}
    if unknown:
        raise InvalidRequestError(f"{where}: unknown keys {sorted(unknown)}")
    rules, notes = [], []
    for entry in data.get("rules", []) or []:
        if not isinstance(entry, Mapping) or not {"pattern", "scheme"} <= set(entry):
            raise InvalidRequestError(f"{where}: each rule needs 'pattern' and 'scheme', got {entry!r}")
        rules.append(Rule(str(entry["pattern"]), str(entry["scheme"])))
    for key, patterns in (("attention_layers", ATTENTION_PATTERNS), ("ffn_layers", FFN_PATTERNS)):
        if key in data:
            scheme, note = _seeds_scheme(data[key], f"{where}: {key}")
            rules.extend(Rule(p, scheme) for p in patterns)
            notes.extend([note] if note else [])
    return Recipe(tuple(rules), str(data.get("default", NONE)), threshold, rotate or None, tuple(notes),
                  None if budget is None else float(budget), tuple(candidates), sensitivity)


def _seeds_scheme(entry: object, where: str) -> tuple[str, str | None]:
    if not isinstance(entry, Mapping) or "type" not in entry:
        raise InvalidRequestError(f"{where}: expected a mapping with 'type', got {entry!r}")
    kind, variant = str(entry["type"]).lower(), entry.get("scheme")
    variant = None if variant is None else str(variant).upper()
    scheme = SEEDS_TYPES.get((kind, variant))
    if scheme is None:
        raise InvalidRequestError(f"{where}: unsupported type/scheme {kind}/{variant} "
                                  f"(supported: {sorted({f'{k}/{v}' if v else k for k, v in SEEDS_TYPES})})")
    group = entry.get("group_size")
    if scheme == "nvfp4" and group is not None and group != NVFP4_GROUP:
        return scheme, (f"{where}: group_size {group} read as NVFP4's own {NVFP4_GROUP} (an E4M3 scale per 16 "
                        "values is the format; vLLM and compressed-tensors accept no other)")
    if group is not None and scheme != "nvfp4":
        raise InvalidRequestError(f"{where}: group_size is not a parameter of {kind}; name a grouped scheme in a rule")
    return scheme, None
