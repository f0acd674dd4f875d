"""The cleaning pipeline's settings: per step its datatrove keyword arguments (published thresholds by
default), per-language overrides, `false` to switch a step off; read from a YAML or JSON file."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from glmserve.errors import InvalidRequestError

# Steps in pipeline order. Empty settings = datatrove's defaults, which are the published thresholds
# (Gopher: Rae et al. 2021, Table A1; C4: Raffel et al. 2020, Sec. 2.2; FineWeb: Penedo et al. 2024).
STEPS = ("mojibake", "language", "length", "gopher_repetition", "gopher_quality", "c4_quality", "fineweb_quality",
         "quality", "minhash")

# Chinese function words for Gopher's stop-word rule (its English list cannot match Chinese text)
ZH_STOP_WORDS = ["的", "了", "是", "在", "和", "有", "也", "就", "不", "这", "我们", "一个", "与", "中", "对"]

DEFAULTS: dict[str, Any] = {
    "languages": ["en", "zh"],
    "mojibake": {"max_marks_per_100_chars": 0.3},
    "language": {"min_probability": 0.65},
    # Gopher's 50 words, counted on the whole document (the rules below see its prose, without the code)
    "length": {"min_words": 50},
    # word and line statistics are judged on the prose view (glmserve/data/text.py: code, tables, headings and
    # markup left out), so that a README's repeated `import` line or a docstring's doctests do not fail them
    "gopher_repetition": {"view": "prose"},
    # jieba words are 1-3 characters: Gopher's 3-10 mean word length is for English
    "gopher_quality": {"view": "prose", "min_doc_words": None,
                       "zh": {"min_avg_word_length": 1, "max_avg_word_length": 6, "stop_words": ZH_STOP_WORDS}},
    # C4 and FineWeb count lines as paragraphs (web text); plain text hard-wrapped at 72 columns (licenses,
    # man pages) is seen unwrapped, else every wrapped line "lacks terminal punctuation"
    # tuned on the benchmark's 'tune' split (bench/RESULTS.md "Training data"): C4's curly-bracket rule drops
    # every technical document with a code or dict example, and its sentence count (lines without terminal
    # punctuation dropped first) removed only valid API references there (attribute lists): one is asked
    "c4_quality": {"view": "prose", "filter_curly_bracket": False, "min_num_sentences": 1},
    # FineWeb's published rule drops documents with >= 10% of characters in duplicated lines (Penedo et al.
    # 2024, "custom heuristic filters"); datatrove's default is 0.01
    "fineweb_quality": {"view": "prose", "char_duplicates_ratio": 0.1},
    # the learned score (glmserve/data/quality.py): a rule's rejection is overruled at p(valid) >= rescue_score
    # (chosen on the tune split's out-of-fold scores, bench/RESULTS.md "Training data"); min_score, when set,
    # also drops documents scored under it; model: a .npz from `glmserve data train-quality` (None: shipped)
    "quality": {"model": None, "rescue_score": 0.5, "min_score": None},
    "minhash": {"n_grams": 5, "num_buckets": 14, "hashes_per_bucket": 8},
}


def _merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None) -> dict[str, Any]:
    """DEFAULTS merged with the file's settings (YAML or JSON); unknown keys are an error."""
    if path is None:
        return copy.deepcopy(DEFAULTS)
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise InvalidRequestError(f"cannot read config file {p}: {e}") from e
    import yaml

    try:
        user = json.loads(text) if p.suffix == ".json" else (yaml.safe_load(text) or {})
    except (ValueError, yaml.YAMLError) as e:
        raise InvalidRequestError(f"config file {p} is not valid: {e}") from e
    if not isinstance(user, dict):
        raise InvalidRequestError(f"config file {p} must hold a mapping of step names to settings")
    unknown = set(user) - set(DEFAULTS)
    if unknown:
        raise InvalidRequestError(f"config file {p}: unknown keys {sorted(unknown)} (known: {sorted(DEFAULTS)})")
    return _merge(DEFAULTS, user)
