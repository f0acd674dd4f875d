"""The cost of grammar masks per decode step (glmserve/engine/structured.py), at batch 1 and 32.

For each batch size, runs B requests in steady decode without a grammar and with a JSON schema (a long string
field, so that no sequence finishes early), interleaved, and reports the median step time of each, the median
time of the mask itself (llguidance's batched bitmask fill + the sampler's tensor op, timed around
`sampler.apply_grammars`) and its share of the guided step.

    PYTHONPATH=. .venv/bin/python bench/bench_structured.py [--steps 16] [--repeats 3] [--quantization none]

`--suite` instead runs the shipped schema suite (tests/data/schemas/), every schema in one batch (`--n` samples at
temperature 1): the share of outputs that validate (jsonschema) and of schemas llguidance refuses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jsonschema

from glmserve.config import EngineConfig
from glmserve.engine import sampler
from glmserve.engine.llm_engine import LLMEngine
from glmserve.engine.sampling import SamplingParams
from glmserve.engine.structured import GrammarCompileError, GuidedSpec

SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                           "story": {"type": "string"}}, "required": ["title", "story"]}
mask_times: list[float] = []


def _timed_grammars(original):
    def run(logits, seqs):
        start = time.perf_counter()
        original(logits, seqs)
        mask_times.append(time.perf_counter() - start)
    return run


def decode_steps(engine: LLMEngine, batch: int, steps: int, guided: bool, tag: str) -> list[float]:
    """Step times of `steps` decode steps of `batch` requests (after their prefill)."""
    params = SamplingParams(temperature=1.0, max_tokens=steps + 8, ignore_eos=True,
                            guided=GuidedSpec.json_schema(SCHEMA) if guided else None)
    prompt = engine.apply_chat_template([{"role": "user", "content": "Tell me a long story as JSON."}])
    ids = [f"{tag}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, prompt, params)
    while any(not engine.requests[r].seqs[0].output_token_ids for r in ids):
        engine.step()
    mask_times.clear()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for request_id in ids:
        engine.abort_request(request_id)
    return times


def schema_suite(engine: LLMEngine, n: int, max_tokens: int) -> None:
    paths = sorted((Path(__file__).resolve().parents[1] / "tests" / "data" / "schemas").glob("*.json"))
    schemas = {p.stem: json.loads(p.read_text()) for p in paths}
    refused = []
    for name, schema in schemas.items():
        ask = [{"role": "user", "content": f"Give an example of a {name.replace('_', ' ')} as JSON."}]
        params = SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=max_tokens,
                                guided=GuidedSpec.json_schema(schema))
        try:
            engine.add_request(name, engine.apply_chat_template(ask), params)
        except GrammarCompileError as exc:
            refused.append(name)
            print(f"refused {name}: {str(exc)[:160]}")
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    valid = total = 0
    for name, out in sorted(outputs.items()):
        for c in out.outputs:
            total += 1
            try:
                jsonschema.validate(json.loads(c.text), schemas[name])
                valid += c.finish_reason == "stop"
            except (ValueError, jsonschema.ValidationError) as exc:
                print(f"invalid {name} ({c.finish_reason}): {str(exc)[:160]}")
    print(f"schemas: {len(schemas)}; refused by llguidance: {len(refused)} ({len(refused) / len(schemas):.0%}); "
          f"outputs of the others valid: {valid}/{total} ({valid / max(total, 1):.0%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--quantization", default=None, help="none: float weights (default: the checkpoint's)")
    parser.add_argument("--suite", action="store_true", help="run the schema suite instead")
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=400)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(num_threads=args.threads, max_num_seqs=32, max_model_len=1024,
                                    kv_cache_memory_bytes=256 << 20, quantization=args.quantization))
    if args.suite:
        schema_suite(engine, args.n, args.max_tokens)
        return
    engine.grammars.compile(GuidedSpec.json_schema(SCHEMA))  # as the server does, before the request
    sampler.apply_grammars = _timed_grammars(sampler.apply_grammars)
    print("| batch | step, no grammar (ms) | step, JSON schema (ms) | mask (ms) | mask / guided step "
          "| guided / plain |")
    print("|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        plain, guided, masks = [], [], []
        for r in range(args.repeats):  # interleaved A/B
            plain += decode_steps(engine, batch, args.steps, False, f"p{batch}-{r}")
            guided += decode_steps(engine, batch, args.steps, True, f"g{batch}-{r}")
            masks += mask_times
        p, g, m = (statistics.median(x) * 1e3 for x in (plain, guided, masks))
        print(f"| {batch} | {p:.1f} | {g:.1f} | {m:.2f} | {m / g:.1%} | {g / p:.2f}x |")


if __name__ == "__main__":
    main()
