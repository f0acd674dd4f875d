"""Quantized KV (`--kv-cache-dtype int8|fp8`) against float KV on the embedded SmolLM2-135M (fp32 weights), in one
run: KV bytes per token, passkey / needle retrieval hits, and decode speed as a ratio to float32 KV.

    .venv/bin/python bench/bench_kv_quant.py [--formats float32,bfloat16,int8,fp8] [--lengths 1024,2048]
                                             [--threads 1] [--out FILE]
    .venv/bin/python bench/bench_kv_quant.py --attention-only [--contexts 8192,32768] [--attention-batch 1]
                                             [--attention-pool-mb 0] [--out FILE]

- retrieval: bench_sparse.py's passkey and needle-in-a-haystack prompts (the same haystacks, keys and question),
  dense attention, the answer decoded (24 tokens); a hit = the number appears in it;
- decode speed: a batch of `--batch` prompts of `--context` tokens is prefilled, then `--steps` decode steps are
  timed (engine steps after the prefill); formats take turns, `--repeats` rounds, the median per format;
  reported as tok/s and the ratio to float32 KV;
- `--attention-only`: the decode attention of one SmolLM2 layer alone (9 query heads, 3 kv heads, head_dim 64,
  `--attention-batch` sequences, default 1) over a pool of random K/V written in each format (with
  `--attention-pool-mb`: cycled over that many MB of layer pools, so that K/V come from memory as in an engine
  step), through the engine's decode path (the C++ kernel of the active instruction set, or PyTorch with
  GLMSERVE_TORCH_ONLY=1): ms per call, formats in turns, medians, ratio to float32 KV. Where the KV is larger than
  the caches, this is where its bytes show.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from bench_sparse import PASSKEY_FILLER, chat_prompt, haystack, prose
from paged_decode_ab import DIM, decode_case, layer_pools

from glmserve import LLM, SamplingParams
from glmserve.layers.partial_attention import paged_attention_with_lse


def engine(kv: str, max_len: int) -> LLM:
    return LLM(model=None, dtype="float32", kv_cache_dtype=kv, max_model_len=max_len, max_num_seqs=16,
               max_num_batched_tokens=2048, kv_cache_memory_bytes=160 << 20, sparse_block_bounds=False)


def retrieval(llms: dict[str, LLM], lengths: list[int], depths: list[float]) -> dict:
    """Hits per task and format over the same prompts (every format answers each prompt in turn)."""
    rng, sentences = random.Random(0), prose()
    params = SamplingParams(temperature=0, max_tokens=24)
    first = next(iter(llms.values()))
    hits = {task: dict.fromkeys(llms, 0) for task in ("passkey", "niah")}
    total = 0
    for length in lengths:
        for depth in depths:
            key = str(rng.randint(10000, 99999))
            city = rng.choice(["Paris", "Lisbon", "Nairobi", "Osaka", "Quito", "Oslo", "Lima", "Hanoi"])
            tasks = {
                "passkey": (haystack(first.tokenizer, [PASSKEY_FILLER.strip()], length,
                                     f"The pass key is {key}. Remember it. {key} is the pass key.", depth),
                            "What is the pass key? Answer with the number only."),
                "niah": (haystack(first.tokenizer, sentences, length,
                                  f"The special magic number for {city} is {key}.", depth),
                         f"What is the special magic number for {city}? Answer with the number only."),
            }
            total += 1
            for task, (text, question) in tasks.items():
                prompt = chat_prompt(first, text, question)
                line = []
                for name, llm in llms.items():
                    answer = llm.generate([prompt], params)[0].outputs[0].text
                    hit = key in answer.replace(",", "").replace(" ", "")
                    hits[task][name] += hit
                    line.append(f"{name}={'hit' if hit else 'miss'}")
                print(f"  {task} {len(prompt)} tokens depth {depth}: {', '.join(line)}", flush=True)
    return {"hits": hits, "prompts_per_task": total}


def decode_rate(llm: LLM, prompts: list[list[int]], steps: int) -> float:
    """Decode tok/s of the batch: engine steps after the one that prefills every prompt."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"speed-{time.perf_counter_ns()}-{i}", p, params)
    engine.step()  # the prefill (max_num_batched_tokens holds the batch)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return steps * len(prompts) / (time.perf_counter() - start)


def attention_ms(contexts: list[int], names: list[str], repeats: int, batch: int = 1, pool_mb: int = 0,
                 calls: int = 20) -> dict:
    """ms per decode-attention call of one layer (`batch` sequences of `context` keys each, their slots in
    shuffled blocks of 16 as the engine's block tables give them), per format (formats in turns). With `pool_mb`
    the calls cycle over as many layer pools as make at least that many MB of float32 K/V, so that the keys come
    from memory as in the engine's step (30 layers' caches), not from a cache that one layer's loop keeps warm."""
    gen = torch.Generator().manual_seed(0)
    out: dict = {}
    for context in contexts:
        q, k, v, slots, lengths, layers = decode_case(context, batch, pool_mb, gen)
        pools = {name: layer_pools(name, k, v, layers) for name in names}
        times: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(repeats):
            for name, caches in pools.items():
                paged_attention_with_lse(q, caches[0], slots, lengths, DIM**-0.5)  # warm
                n = max(calls, len(caches))
                start = time.perf_counter()
                for i in range(n):
                    paged_attention_with_lse(q, caches[i % len(caches)], slots, lengths, DIM**-0.5)
                times[name].append((time.perf_counter() - start) / n * 1e3)
        median = {n: statistics.median(t) for n, t in times.items()}
        out[context] = {"ms": median, "ratio_vs_first": {n: median[names[0]] / median[n] for n in names},
                        "layers": layers}
        print(f"  attention, batch {batch} x {context} keys, {layers} layer pool(s), ms/call: "
              + ", ".join(f"{n} {m:.3f} ({median[names[0]] / m:.2f}x)" for n, m in median.items()), flush=True)
        del pools
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="float32,bfloat16,int8,fp8")
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--depths", default="0.2,0.5,0.8")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=480)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--attention-only", action="store_true")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--attention-batch", type=int, default=1, help="--attention-only: sequences per call")
    ap.add_argument("--attention-pool-mb", type=int, default=0,
                    help="--attention-only: cycle over layer pools of at least this many MB of float32 K/V")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = args.formats.split(",")
    if args.attention_only:
        result = {"attention": attention_ms([int(c) for c in args.contexts.split(",")], names, args.repeats,
                                            args.attention_batch, args.attention_pool_mb)}
        if args.out:
            args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, **result}, indent=1))
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    llms = {name: engine(name, max(lengths) + 512) for name in names}
    model = next(iter(llms.values())).engine.runner.model
    result: dict = {"bytes_per_token": {n: model.kv_bytes_per_token(n) for n in names}}
    bf16 = model.kv_bytes_per_token("bfloat16")
    print("KV bytes per token:", ", ".join(f"{n} {b} ({b / bf16:.3f}x bf16)"
                                          for n, b in result["bytes_per_token"].items()), flush=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (args.context,), generator=gen).tolist() for _ in range(args.batch)]
    rates: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.repeats):  # formats take turns: drift on a shared machine hits every format alike
        for name, llm in llms.items():
            rates[name].append(decode_rate(llm, prompts, args.steps))
    median = {n: statistics.median(r) for n, r in rates.items()}
    result["decode_tok_s"] = median
    result["decode_ratio_vs_float32"] = {n: median[n] / median[names[0]] for n in names}
    print("decode tok/s (median):", ", ".join(f"{n} {r:.1f} ({r / median[names[0]]:.2f}x)"
                                              for n, r in median.items()), flush=True)
    result["retrieval"] = retrieval(llms, lengths, [float(x) for x in args.depths.split(",")])
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, **result}, indent=1))


if __name__ == "__main__":
    main()
