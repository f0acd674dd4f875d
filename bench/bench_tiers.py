"""Time to first token for a long shared prefix: cold compute vs a device-pool hit vs a host-tier hit vs a
disk-tier hit (and a disk hit after an engine restart), with the cost of spilling and loading per chunk.

Random weights of SmolLM2-135M's shape with `max_position_embeddings` raised to fit the prefix (speed does
not depend on the values). Each request is the shared prefix plus a distinct 16-token question; one new
token is generated, so the request's wall time is its TTFT. The device pool holds a little more than one
request, so a second, unrelated prefix of the same length evicts the first (its chunks go down a tier).

    python bench/bench_tiers.py --prefix 32768 [--chunk-tokens 2048] [--out results.json]

Steps, each tier on a fresh engine:
  disk engine (host tier off, disk tier in a temp dir): cold, device hit, evict, disk hit; then a new engine
  on the same directory (a restart): disk hit;
  host engine (host tier only): cold, evict, host hit.
Prints one JSON object (seconds); `--out` also writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from glmserve import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from bench_cuda import SMOLLM2_SHAPE, make_model  # noqa: E402

TAIL = 16


def kv_bytes_per_token(dtype: torch.dtype) -> int:
    s = SMOLLM2_SHAPE
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * head_dim * size


def tokens(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, SMOLLM2_SHAPE["vocab_size"], (n,), generator=gen).tolist()


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """Wall seconds of a one-token request and its cached prompt tokens."""
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
    return time.perf_counter() - start, out.num_cached_tokens


def tier_stats(llm: LLM) -> dict:
    s = llm.engine.kv.tiers.stats
    return {
        "saved_chunks": s.saved_chunks, "loaded_chunks": s.loaded_chunks, "loaded_tokens": s.loaded_tokens,
        "save_s_per_chunk": s.save_seconds / max(s.saved_chunks, 1),  # in the engine step
        "disk_write_s_per_chunk": s.write_seconds / max(s.saved_chunks, 1),  # in the writer thread
        "load_s_per_chunk": s.load_seconds / max(s.loaded_chunks, 1),
    }


def drop_page_cache(root: Path) -> None:
    """Asks the kernel to forget the tier's (written, fsynced) file pages, so that a disk hit reads the disk."""
    for path in root.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fresh(llm_kwargs: dict) -> LLM:
    """An engine warmed up on a short unrelated request (CUDA context, kernels, allocator)."""
    llm = LLM(**llm_kwargs)
    ttft(llm, tokens(99, 64))
    return llm


def run(args: argparse.Namespace, model_dir: Path, disk_dir: Path) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    max_len = args.prefix + 4 * TAIL
    common = dict(model=str(model_dir), max_model_len=max_len, max_num_batched_tokens=args.batch_tokens,
                  kv_chunk_tokens=args.chunk_tokens, max_num_seqs=4, sparse_block_bounds=False,
                  # the pool holds one request and one block more: the other prefix evicts nearly all of it
                  kv_cache_memory_bytes=kv_bytes_per_token(dtype) * (max_len + 2 * 16))
    if args.num_threads:
        common["num_threads"] = args.num_threads
    prefix, other = tokens(1, args.prefix), tokens(2, args.prefix)
    ask = [tokens(10 + i, TAIL) for i in range(6)]
    chunk_bytes = kv_bytes_per_token(dtype) * args.chunk_tokens
    host_bytes = chunk_bytes * (args.prefix // args.chunk_tokens + 1)
    result: dict = {"device": device, "dtype": str(dtype), "prefix_tokens": args.prefix,
                    "chunk_tokens": args.chunk_tokens, "chunk_mb": chunk_bytes / 1e6}

    llm = fresh(dict(common, kv_host_memory_bytes=0, kv_disk_dir=str(disk_dir)))
    result["cold_s"], _ = ttft(llm, prefix + ask[0])
    result["device_hit_s"], result["device_hit_cached"] = ttft(llm, prefix + ask[1])
    result["evict_cold_s"], _ = ttft(llm, other + ask[2])  # a cold prefill that also spills the prefix
    llm.engine.kv.tiers.wait()  # the disk hit below reads files, not chunks still waiting for the writer
    drop_page_cache(disk_dir)
    result["disk_hit_s"], result["disk_hit_cached"] = ttft(llm, prefix + ask[3])
    result["disk"] = tier_stats(llm)
    llm.engine.kv.tiers.wait()
    result["disk_mb"] = sum(p.stat().st_size for p in disk_dir.iterdir()) / 1e6
    del llm
    drop_page_cache(disk_dir)
    restarted = fresh(dict(common, kv_host_memory_bytes=0, kv_disk_dir=str(disk_dir)))
    result["disk_hit_after_restart_s"], result["disk_hit_after_restart_cached"] = ttft(restarted, prefix + ask[4])
    del restarted

    if not args.skip_host:
        llm = fresh(dict(common, kv_host_memory_bytes=host_bytes))
        result["host_cold_s"], _ = ttft(llm, prefix + ask[0])
        ttft(llm, other + ask[2])
        result["host_hit_s"], result["host_hit_cached"] = ttft(llm, prefix + ask[5])
        result["host"] = tier_stats(llm)
    # the fastest of the cold prefills (the first one in a process also pays one-time costs)
    result["cold_best_s"] = min(result[k] for k in ("cold_s", "evict_cold_s", "host_cold_s") if k in result)
    for key in ("device_hit_s", "host_hit_s", "disk_hit_s", "disk_hit_after_restart_s"):
        if key in result:
            result[key[:-2] + "_over_cold"] = result[key] / result["cold_best_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, default=32768, help="shared prefix tokens")
    parser.add_argument("--chunk-tokens", type=int, default=2048)
    parser.add_argument("--batch-tokens", type=int, default=2048, help="max_num_batched_tokens (prefill chunk)")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--work-dir", default=None, help="where the model and the disk tier go (default: a temp dir)")
    parser.add_argument("--skip-host", action="store_true",
                        help="no host-tier engine (two fewer cold prefills; CPU has no host tier by default)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-tiers-", dir=args.work_dir))
    try:
        model_dir = make_model(work / "model", max_position_embeddings=args.prefix + 4 * TAIL)
        result = run(args, model_dir, work / "disk")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
