"""Sparse decode attention: retrieval quality on SmolLM2, speed and memory at long context.

    .venv/bin/python bench/bench_sparse.py quality [--quick] [--out FILE]
    .venv/bin/python bench/bench_sparse.py speed [--contexts 8192,32768,131072] [--device cpu|cuda] [--out FILE]

quality (the embedded SmolLM2-135M-Instruct, fp32, 8K context), every mode on the same prompts:
- passkey retrieval (the filler of Mohtashami & Jaggi 2023, "Landmark Attention", with a 5-digit key
  at 3 depths) and needle-in-a-haystack (a "special magic number" sentence hidden in real English prose:
  Python's standard-library docstrings) at 2K/4K/8K tokens, asked through the chat template after the
  haystack, so the whole answer is decoded; a hit = the number appears in the first 24 answer tokens.
  Each prompt's haystack is prefilled once (dense) and reused by every mode through the prefix cache:
  the modes differ only where sparse attention acts, in decode.
- next-token agreement on real text: at 8 positions of a long prose document, the second generated
  token's full distribution (the first comes from the dense prefill, so every mode decodes it in the same
  context): top-1 agreement with dense and KL(dense || mode).
- dropped attention mass: for every sparse decode query of the agreement run, the share of the dense
  softmax mass (mean over heads and layers) that falls on keys the mode did not select, and the share of
  the context it attends.

speed (random weights of SmolLM2's shape, positions up to 128K; the KV of the context is written directly
into the paged pool, then decode steps run through the engine): decode tok/s per context and mode (the mean
of the timed engine steps after the request's prefill step, which recomputes the prompt's tail), the
indexer's own time per step (scoring + selection, measured around those calls), and peak RSS of one
process per context length (the KV is resident in every mode; tiers are what move it out of memory).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

from glmserve import LLM, SamplingParams
from glmserve.kv.slots import slots_of
from glmserve.layers import attention as attention_module
from glmserve.layers.partial_attention import gather_kv
from glmserve.models.loader import load_model
from glmserve.sparse import selection
from glmserve.sparse.learned import IndexerSpec, LearnedIndexerWeights, ModelIdentity, default_indexer_path
from glmserve.training.indexer_distill import DistillConfig

QUALITY_MODES = {
    "dense": {"mode": "dense"},
    "block-k512": {"mode": "block", "top_k": 512},
    "block-t0.35": {"mode": "block", "threshold": 0.35},
    "learned-k512": {"mode": "learned", "top_k": 512},
    "learned-t0.35": {"mode": "learned", "threshold": 0.35},
    "block-k2048": {"mode": "block", "top_k": 2048},
    "learned-k2048": {"mode": "learned", "top_k": 2048},
}
DEFAULT_QUALITY_MODES = "dense,block-k512,block-t0.35,learned-k512,learned-t0.35"
SPEED_MODES = {
    "dense": {"mode": "dense"},
    "block-k2048": {"mode": "block", "top_k": 2048},
    "learned-k2048": {"mode": "learned", "top_k": 2048},
}
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
STDLIB_MODULES = (
    "argparse", "asyncio", "collections", "concurrent.futures", "configparser", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email.message", "enum", "fractions", "functools", "heapq", "http.client",
    "http.server", "inspect", "io", "ipaddress", "itertools", "json", "logging", "mailbox", "mimetypes",
    "multiprocessing", "optparse", "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "sched",
    "secrets", "selectors", "shutil", "smtplib", "socket", "sqlite3", "ssl", "statistics", "string", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "typing", "unittest", "urllib.parse",
    "urllib.request", "uuid", "weakref", "xml.dom.minidom", "zipfile",
)


# -- text ------------------------------------------------------------------------------------------------
def prose() -> list[str]:
    """Sentences of real English prose, the same on every machine with this Python: the docstrings of
    standard-library modules and their public members."""
    docs: list[str] = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        for obj in [module, *(getattr(module, a) for a in sorted(dir(module)) if not a.startswith("_"))]:
            doc = inspect.getdoc(obj) if inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj) else None
            if doc and doc not in docs:
                docs.append(doc)
    text = " ".join(" ".join(p.split()) for d in docs for p in d.split("\n\n") if not p.lstrip().startswith(">>>"))
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if 20 < len(s) < 400]


def haystack(tokenizer, sentences: list[str], target_tokens: int, needle: str, depth: float) -> str:
    """Sentences (cycled) up to about `target_tokens`, with `needle` inserted at fraction `depth`."""
    chosen, count, i = [], 0, 0
    while count < target_tokens:
        s = sentences[i % len(sentences)]
        chosen.append(s)
        count += len(tokenizer.encode(" " + s, add_special_tokens=False))
        i += 1
    chosen.insert(int(depth * len(chosen)), needle)
    return " ".join(chosen)


# -- instrumentation ---------------------------------------------------------------------------------------
class Recorder:
    """Wraps PagedAttention decode (dropped mass, attended share) and the model (decode logits)."""

    def __init__(self) -> None:
        self.dropped: list[float] = []
        self.attended: list[float] = []
        self.decode_logits: list[torch.Tensor] = []

    @contextmanager
    def active(self, model: torch.nn.Module):
        original = attention_module.PagedAttention._decode
        recorder = self

        def measuring_decode(layer, q, g):
            if g.sparse is not None and g.sparse.modes != {"dense"}:
                recorder.measure(layer, q, g)
            return original(layer, q, g)

        def keep_logits(_module, args, out):
            meta = args[2]
            if meta.prefill is None:
                recorder.decode_logits.append(out.detach().cpu())

        attention_module.PagedAttention._decode = measuring_decode
        hook = model.register_forward_hook(keep_logits)
        try:
            yield self
        finally:
            attention_module.PagedAttention._decode = original
            hook.remove()

    def measure(self, layer, q: torch.Tensor, g) -> None:
        modes = g.sparse.modes - {"dense"}
        scoring = g.scoring_rows()
        scores = {m: layer.indexers[m].unit_scores(q, scoring) for m in modes}
        units = {m: layer.indexers[m].unit_size for m in modes}
        keep = selection.decode_keep_mask(scores, units, g.context_lens, g.sparse, g.kv_slots.shape[1], g.sparse.pins)
        keys, _ = gather_kv(layer.kv_cache, g.kv_slots, q.dtype)  # [Hkv, B, L, D]
        b = q.shape[0]
        qg = q.view(b, layer.num_kv_heads, -1, layer.head_dim).transpose(0, 1)
        logits = torch.matmul(qg, keys.transpose(-1, -2)) * layer.scale  # [Hkv, B, g, L]
        logits.masked_fill_(~g.key_mask, float("-inf"))
        probs = torch.softmax(logits.float(), dim=-1)
        kept_mass = (probs * keep[None, :, None, :]).sum(-1).mean(dim=(0, 2))  # [B]
        self.dropped.extend((1 - kept_mass).tolist())
        self.attended.extend((keep.sum(1) / g.context_lens).tolist())


# -- quality ------------------------------------------------------------------------------------------------
def chat_prompt(llm: LLM, text: str, question: str) -> list[int]:
    return llm.engine.apply_chat_template([{"role": "user", "content": f"{text}\n\n{question}"}])


def retrieval(llm: LLM, modes: dict[str, dict], lengths: list[int], depths: list[float],
              sentences: list[str], seed: int = 0) -> dict:
    """`seed` draws each prompt's key and city (seed 0 with depths 0.2/0.5/0.8: the prompts the pin rule was
    tuned on; other seeds and depths are prompts it never saw)."""
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=24)
    hits: dict[str, dict[str, dict[int, int]]] = {t: {m: defaultdict(int) for m in modes} for t in ("passkey", "niah")}
    samples: list[dict] = []
    for length in lengths:
        for depth in depths:
            key = str(rng.randint(10000, 99999))
            city = rng.choice(["Paris", "Lisbon", "Nairobi", "Osaka", "Quito", "Oslo", "Lima", "Hanoi"])
            tasks = {
                "passkey": (haystack(llm.tokenizer, [PASSKEY_FILLER.strip()], length,
                                     f"The pass key is {key}. Remember it. {key} is the pass key.", depth),
                            "What is the pass key? Answer with the number only."),
                "niah": (haystack(llm.tokenizer, sentences, length,
                                  f"The special magic number for {city} is {key}.", depth),
                         f"What is the special magic number for {city}? Answer with the number only."),
            }
            for task, (text, question) in tasks.items():
                prompt = chat_prompt(llm, text, question)
                for mode, sparse in modes.items():
                    answer = llm.generate([prompt], params, sparse=sparse)[0].outputs[0].text
                    hit = key in answer.replace(",", "").replace(" ", "")
                    hits[task][mode][length] += hit
                    samples.append({"task": task, "tokens": len(prompt), "depth": depth, "mode": mode,
                                    "key": key, "answer": answer[:80], "hit": hit})
                print(f"  {task} {len(prompt)} tokens depth {depth}: "
                      + ", ".join(f"{s['mode']}={'hit' if s['hit'] else 'miss'}" for s in samples[-len(modes):]),
                      flush=True)
    return {"hits": {t: {m: dict(v) for m, v in per.items()} for t, per in hits.items()},
            "per_length": len(depths), "samples": samples}


def agreement(llm: LLM, modes: dict[str, dict], sentences: list[str], positions: list[int]) -> dict:
    """Second generated token at each position: its logits come from the last decode step of the request."""
    tokens = llm.tokenizer.encode(" ".join(sentences[len(sentences) // 3:]), add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    out: dict[str, dict[str, float]] = {}
    reference: tuple[torch.Tensor, list[int]] | None = None
    for mode, sparse in modes.items():
        recorder = Recorder()
        rows, first_tokens = [], []
        with recorder.active(llm.engine.runner.model):
            for p in positions:
                first_tokens.append(llm.generate([tokens[:p]], params, sparse=sparse)[0].outputs[0].token_ids[0])
                rows.append(recorder.decode_logits[-1][0])
        logits = torch.stack(rows)
        if reference is None:  # the first mode is dense
            reference = (logits, first_tokens)
        ref, ref_first = reference
        ref_logp, logp = torch.log_softmax(ref, -1), torch.log_softmax(logits, -1)
        same = torch.tensor([a == b for a, b in zip(first_tokens, ref_first)])  # else the contexts differ
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)[same]
        out[mode] = {
            "top1_agreement": float((ref.argmax(-1) == logits.argmax(-1))[same].float().mean()),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "positions_compared": int(same.sum()),
            "dropped_mass_mean": float(torch.tensor(recorder.dropped).mean()) if recorder.dropped else 0.0,
            "attended_share_mean": float(torch.tensor(recorder.attended).mean()) if recorder.attended else 1.0,
        }
        print(f"  agreement {mode}: {out[mode]}", flush=True)
    return out


def quality(args: argparse.Namespace) -> dict:
    llm = LLM(model=None, dtype="float32", max_model_len=8192, max_num_batched_tokens=2048,
              kv_cache_memory_bytes=1536 << 20)
    asked = ["dense"] + [m for m in args.modes.split(",") if m != "dense"]  # dense first: the reference
    modes = {m: QUALITY_MODES[m] for m in asked if QUALITY_MODES[m]["mode"] in llm.engine.sparse_modes}
    skipped = sorted(set(asked) - set(modes))
    sentences = prose()
    lengths = [2048, 4096] if args.quick else [2048, 4096, 7800]
    depths = [0.5] if args.quick else [float(d) for d in args.depths.split(",")]
    # 8 past a block boundary: the prompt's tail is prefilled (dense) in every mode, never a 1-token decode step
    positions = [16 * k + 8 for k in ((64, 128) if args.quick else (94, 156, 219, 281, 344, 406, 469, 500))]
    start = time.perf_counter()
    result = {
        "model": llm.engine.model_name, "modes": modes, "skipped_modes": skipped,
        "seed": args.seed, "retrieval": retrieval(llm, modes, lengths, depths, sentences, args.seed),
        "agreement": agreement(llm, modes, sentences, positions),
    }
    result["seconds"] = time.perf_counter() - start
    return result


# -- speed --------------------------------------------------------------------------------------------------
def random_long_model(out: Path, max_positions: int) -> Path:
    """SmolLM2-135M's shape with random weights and positions up to `max_positions`."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_cuda import make_model

    path = make_model(out, max_position_embeddings=max_positions)
    # an untrained learned indexer of the default size: its cost per step is what the speed run measures
    model = load_model(str(path), None, torch.device("cpu"), torch.float32).model
    identity = ModelIdentity.of(model)
    weights = LearnedIndexerWeights(IndexerSpec(identity, DistillConfig.dim, DistillConfig.heads))
    weights.save(default_indexer_path(path, identity.fingerprint))
    return path


def fill_context(llm: LLM, token_ids: list[int], chunk: int = 8192) -> None:
    """Writes random K/V for `token_ids` straight into the paged pool and registers the blocks in the prefix
    cache, as if a prefill had run; a request with these tokens then starts decoding at once."""
    engine = llm.engine
    engine.add_request("fill", token_ids, SamplingParams(max_tokens=1))
    seq = engine.scheduler.waiting.pop(0)
    engine.kv.blocks.admit(seq.kv, [], seq.recomputed_tail)
    assert engine.kv.blocks.allocate(seq.kv, len(token_ids)), "KV pool too small for this context"
    gen = torch.Generator(device=engine.device).manual_seed(0)
    for start in range(0, len(token_ids), chunk):
        write_random_kv(engine, seq.kv.block_table, start, min(chunk, len(token_ids) - start), gen)
    seq.num_computed_tokens = len(token_ids)
    engine.kv.blocks.register_full_blocks(seq.kv)
    engine.scheduler.remove(seq)
    engine.requests.pop("fill")


def write_random_kv(engine, block_table: list[int], start: int, size: int, gen: torch.Generator) -> None:
    """Random K/V for positions [start, start + size) of a sequence with `block_table`, in every layer's pool
    (and its scorers' per-block state), as attention would write them."""
    bs = engine.config.block_size
    pos = torch.arange(start, start + size)
    slots = slots_of(torch.tensor([block_table]), pos[None], bs)[0].to(engine.device)
    for layer in engine.runner.model.layers:
        attn = layer.self_attn.attn
        cache = attn.kv_cache
        shape = (cache.shape[1], size, cache.shape[3])
        k = torch.randn(shape, generator=gen, device=cache.device, dtype=cache.dtype)
        cache[0].index_copy_(1, slots, k)
        cache[1].index_copy_(1, slots, torch.randn(shape, generator=gen, device=cache.device, dtype=cache.dtype))
        for indexer in attn.indexers.values():
            indexer.on_kv_written(slots, k.transpose(0, 1), cache)


@contextmanager
def indexer_timer(totals: dict[str, float], device: torch.device):
    """Adds the time spent in scorers and selection (per call, synchronized on CUDA) to totals['indexer']."""
    original = attention_module.PagedAttention.select

    def timed_select(layer, q, g):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = original(layer, q, g)
        if device.type == "cuda":
            torch.cuda.synchronize()
        totals["indexer"] += time.perf_counter() - start
        return out

    attention_module.PagedAttention.select = timed_select
    try:
        yield
    finally:
        attention_module.PagedAttention.select = original


def decode_step_times(llm: LLM, tokens: list[int], sparse: dict, steps: int, device: torch.device) -> list[float]:
    """Seconds of each of `steps` decode steps of one request over `tokens` (its prefill step, which recomputes
    the prompt's tail after the prefix-cache hit, is not counted)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    engine.add_request(f"speed-{time.perf_counter_ns()}", tokens, params, sparse=sparse)
    times = []
    while engine.has_unfinished_requests():
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    assert len(times) == steps + 1, "the prefill took more than one step"
    return times[1:]


def speed_one_context(model_dir: Path, context: int, device: str, steps: int) -> dict:
    kv_bytes = int(1.15 * 2 * 30 * 3 * 64 * 4 * (context + 4096))  # K/V plus index keys, fp32
    llm = LLM(model=str(model_dir), dtype="float32", device=device, max_model_len=context + 1024,
              kv_cache_memory_bytes=kv_bytes, max_num_seqs=4)
    dev = llm.engine.device
    tokens = torch.randint(3, 49152, (context,), generator=torch.Generator().manual_seed(context)).tolist()
    fill_context(llm, tokens)
    out: dict[str, dict[str, float]] = {}
    for name, sparse in SPEED_MODES.items():
        if sparse["mode"] not in llm.engine.sparse_modes:
            continue
        totals = {"indexer": 0.0}
        with indexer_timer(totals, dev):
            decode_step_times(llm, tokens, sparse, 2, dev)  # warm-up (kernel builds, allocator)
            totals["indexer"] = 0.0
            times = decode_step_times(llm, tokens, sparse, steps, dev)
        step_s = sum(times) / steps
        out[name] = {"decode_tok_s": 1 / step_s, "step_ms": step_s * 1e3,
                     "indexer_ms_per_step": totals["indexer"] / steps * 1e3}
        print(f"  {context} {name}: {out[name]}", flush=True)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    gpu_gb = torch.cuda.max_memory_allocated() / 1e9 if dev.type == "cuda" else None
    return {"modes": out, "peak_rss_mb": rss_mb, "peak_gpu_mem_gb": gpu_gb}


def speed(args: argparse.Namespace) -> dict:
    contexts = [int(c) for c in args.contexts.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = random_long_model(Path(tmp) / "smollm2-shape-long", max(contexts) + 2048)
        for context in contexts:  # one process each, so that peak RSS belongs to one context length
            cmd = [sys.executable, __file__, "speed-one", "--model-dir", str(model_dir), "--context", str(context),
                   "--device", args.device, "--steps", str(args.steps)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            sys.stdout.write(done.stdout.split("RESULT ")[0])
            if done.returncode != 0:
                print(done.stderr[-3000:])
                results[context] = {"error": done.stderr.strip().splitlines()[-1:]}
                continue
            results[context] = json.loads(done.stdout.split("RESULT ")[1])
    for r in results.values():
        modes = r.get("modes", {})
        if "dense" in modes:
            for m in modes.values():
                m["speedup_vs_dense"] = m["decode_tok_s"] / modes["dense"]["decode_tok_s"]
    return {"device": args.device, "threads": torch.get_num_threads(), "contexts": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quality")
    q.add_argument("--quick", action="store_true")
    q.add_argument("--modes", default=DEFAULT_QUALITY_MODES, help="comma-separated: " + ",".join(QUALITY_MODES))
    q.add_argument("--depths", default="0.2,0.5,0.8", help="where the needle sits, as fractions of the haystack")
    q.add_argument("--seed", type=int, default=0, help="draws the keys and cities")
    s = sub.add_parser("speed")
    s.add_argument("--contexts", default="8192,32768,131072")
    s.add_argument("--device", default="cpu")
    s.add_argument("--steps", type=int, default=8)
    one = sub.add_parser("speed-one")
    one.add_argument("--model-dir", type=Path, required=True)
    one.add_argument("--context", type=int, required=True)
    one.add_argument("--device", default="cpu")
    one.add_argument("--steps", type=int, default=8)
    for p in (q, s):
        p.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.command == "speed-one":
        print("RESULT " + json.dumps(speed_one_context(args.model_dir, args.context, args.device, args.steps)))
        return
    result = quality(args) if args.command == "quality" else speed(args)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text if args.command == "speed" else json.dumps({k: v for k, v in result.items() if k != "retrieval"}
                                                           | {"hits": result["retrieval"]["hits"]}, indent=1))


if __name__ == "__main__":
    main()
