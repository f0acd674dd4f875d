"""Peak RSS and decode speed against context length with a fixed KV pool: KV offload vs all-in-memory.

Random weights of SmolLM2-135M's shape (speed and memory do not depend on the values), positions raised to
the longest context. For each context length and mode, one fresh process (so that its peak RSS belongs to
that run alone):
  streaming  — the KV pool holds `--pool-tokens` tokens whatever the context; older chunks (2,048 tokens) go
               to files in a temp dir and every decode step streams them back through attention
               (glmserve/kv/offload.py);
  streaming-block — the same, block-sparse decode (top_k 2,048): offloaded blocks are scored from the bounds
               kept with their chunk and only the picked blocks are read back;
  in-memory  — the pool holds the whole context (the engine's default behaviour without a disk dir);
  in-memory-block — the same, block-sparse decode.
The context's K/V is written straight into the pool (random values, chunk by chunk, offloading as a real
prefill would when the pool runs short) instead of running a quadratic prefill of up to 200K tokens on a CPU;
then the sequence decodes `--steps` tokens through the normal engine step, timed after one warm-up step.

`--memory-limit-gb` caps each process's address space (RLIMIT_AS), the stand-in for a machine that has that
much memory: a run that cannot allocate what it needs fails and is reported as such.

    python bench/bench_long_context.py --contexts 8192,32768,131072,200000 --steps 4 [--memory-limit-gb 6]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from glmserve import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from bench_cuda import SMOLLM2_SHAPE, make_model  # noqa: E402
from bench_sparse import write_random_kv  # noqa: E402

CHUNK = 2048


def kv_bytes_per_token() -> int:
    s = SMOLLM2_SHAPE
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * head_dim * 4  # fp32


BLOCK = {"mode": "block", "top_k": 2048}
MODES = {"streaming": None, "streaming-block": BLOCK, "in-memory": None, "in-memory-block": BLOCK}


def start_long_sequence(llm: LLM, context: int, steps: int, sparse: dict | None = None) -> None:
    """Admits a request of `context` tokens whose first context - 1 tokens already have (random) K/V, written
    chunk by chunk into the pool; when the pool is short, the engine's offload moves old chunks out, as in a
    real chunked prefill. The next engine step computes the last prompt token and samples."""
    engine = llm.engine
    tokens = torch.randint(3, SMOLLM2_SHAPE["vocab_size"], (context,), generator=torch.Generator().manual_seed(0))
    engine.add_request("long", tokens.tolist(), SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True),
                       sparse=sparse)
    scheduler, blocks, offload = engine.scheduler, engine.kv.blocks, engine.kv.offload
    seq = scheduler.waiting.pop(0)
    blocks.admit(seq.kv, [], seq.recomputed_tail)
    gen = torch.Generator().manual_seed(1)
    for start in range(0, context - 1, CHUNK):
        size = min(CHUNK, context - 1 - start)
        while not blocks.allocate(seq.kv, size):
            if offload is None or not offload.offload_oldest(seq.kv):
                raise RuntimeError("the KV pool cannot hold the context")
        write_random_kv(engine, seq.kv.block_table, start, size, gen)
        seq.num_computed_tokens += size
        blocks.register_full_blocks(seq.kv)
    scheduler.running.append(seq)
    seq.status = type(seq.status).RUNNING


def run_one(model_dir: Path, context: int, mode: str, pool_tokens: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory(dir=Path.home() / ".cache") as disk_dir:
        streaming = mode.startswith("streaming")
        pool = pool_tokens if streaming else context + 4 * CHUNK
        start = time.perf_counter()
        llm = LLM(model=str(model_dir), dtype="float32", max_model_len=context + 64, max_num_seqs=4,
                  kv_cache_memory_bytes=int(pool * kv_bytes_per_token() * 1.1),
                  kv_disk_dir=disk_dir if streaming else None)
        start_long_sequence(llm, context, steps + 1, MODES[mode])
        fill_s = time.perf_counter() - start
        engine = llm.engine
        times = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        offload = engine.kv.offload
        result = {
            "context": context, "mode": mode,
            "pool_tokens": engine.kv.blocks.num_usable_blocks * engine.config.block_size,
            "setup_and_fill_s": round(fill_s, 2), "first_step_s": round(times[0], 3),
            "decode_tok_s": round((len(times) - 1) / sum(times[1:]), 3),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        }
        if offload is not None:
            s = offload.stats
            result.update(offloaded_chunks=s.offloaded_chunks, read_slices=s.read_slices,
                          skipped_slices=s.skipped_slices,
                          stream_wait_s_per_step=round(s.read_wait_seconds / len(times), 3))
        llm.engine.close()
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="8192,32768,131072,200000")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--pool-tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--memory-limit-gb", type=float)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", nargs=3, metavar=("MODEL_DIR", "CONTEXT", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        if args.memory_limit_gb:
            limit = int(args.memory_limit_gb * (1 << 30))
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        model_dir, context, mode = args.one
        print("RESULT " + json.dumps(run_one(Path(model_dir), int(context), mode, args.pool_tokens, args.steps)))
        return
    contexts = [int(c) for c in args.contexts.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "model", max_position_embeddings=max(contexts) + 128)
        for context in contexts:
            for mode in args.modes.split(","):
                cmd = [sys.executable, __file__, "--one", str(model_dir), str(context), mode,
                       "--pool-tokens", str(args.pool_tokens), "--steps", str(args.steps)]
                if args.memory_limit_gb:
                    cmd += ["--memory-limit-gb", str(args.memory_limit_gb)]
                done = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if done.returncode == 0 and "RESULT " in done.stdout:
                    result = json.loads(done.stdout.split("RESULT ")[1])
                else:
                    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                    result = {"context": context, "mode": mode, "error": last[-300:]}
                print(json.dumps(result), flush=True)
                results.append(result)
    report = {"threads": torch.get_num_threads(), "memory_limit_gb": args.memory_limit_gb,
              "pool_tokens": args.pool_tokens, "runs": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
