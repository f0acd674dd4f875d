"""A/B of our engine's prefill between two checkouts, interleaved: each sample is a fresh process on one checkout's
code (PYTHONPATH) with the same interpreter and GLMSERVE_BENCH_THREADS, alternating A and B (A first on odd
rounds, B first on even ones). A sample loads the model (`--model`: a GGUF file or model directory; default the
embedded SmolLM2 GGUF), warms up, then times `--repeats` fresh
prompts of each `--prefill` length (1 new token) by the wall clock and by the process's CPU time, and keeps the
medians. Prints per length the medians over rounds of each side, B / A rate ratios, and the 1-minute load average
beside each sample. On a shared host the CPU-time rate of one thread counts only the work itself; with two threads
it also counts OpenMP's spinning at barriers, so the wall clock is the figure there.

    GLMSERVE_BENCH_THREADS=1 .venv/bin/python bench/ab_prefill.py --a /work/main --b . [--rounds 5] \
        [--prefill 512,2048] [--repeats 3] [--model FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def measure(lengths: list[int], repeats: int, model: str | None) -> dict[str, float]:
    """In the child: {"<n> wall": tok/s, "<n> cpu": tok/s} medians over `repeats` fresh prompts per length."""
    import torch
    import workloads as wl

    from glmserve import LLM, SamplingParams

    torch.set_num_threads(wl.THREADS)
    llm = LLM(model=model, num_threads=wl.THREADS)
    maker = wl.PromptMaker(wl.load_tokenizer(wl.embedded_gguf_path()), wl.SEED + 17)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for n in lengths:  # warm-up: kernels, scratch buffers and the allocator at each length
        llm.generate([maker.tokens(n)], one)
    rates: dict[str, list[float]] = {}
    for _ in range(repeats):
        for n in lengths:
            prompt = maker.tokens(n)
            wall, cpu = time.perf_counter(), time.process_time()
            llm.generate([prompt], one)
            rates.setdefault(f"{n} wall", []).append(n / (time.perf_counter() - wall))
            rates.setdefault(f"{n} cpu", []).append(n / (time.process_time() - cpu))
    return {k: statistics.median(v) for k, v in rates.items()}


def sample(checkout: Path, lengths: str, repeats: int, model: str | None) -> tuple[dict[str, float], float]:
    env = {**os.environ, "PYTHONPATH": f"{checkout}:{HERE}", "OMP_NUM_THREADS": os.environ.get(
        "GLMSERVE_BENCH_THREADS", "2")}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", "--prefill", lengths,
                          "--repeats", str(repeats), *(["--model", model] if model else [])],
                         env=env, cwd=HERE, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"the sample on {checkout} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1]), os.getloadavg()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, help="checkout A (the baseline)")
    parser.add_argument("--b", type=Path, help="checkout B")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefill", default="512,2048")
    parser.add_argument("--repeats", type=int, default=3, help="prompts per length in one sample (median)")
    parser.add_argument("--model", help="a GGUF file or model directory (default: the embedded SmolLM2 GGUF)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure([int(n) for n in args.prefill.split(",")], args.repeats, args.model)))
        return
    if args.a is None or args.b is None:
        parser.error("--a and --b are required")
    runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
            rates, load = sample(args.a if side == "A" else args.b, args.prefill, args.repeats, args.model)
            runs[side].append(rates)
            print(f"round {r + 1} {side}: " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items())
                  + f" tok/s, load {load:.2f}", flush=True)
    print(f"\nthreads {os.environ.get('GLMSERVE_BENCH_THREADS', '2')}, medians of {args.rounds} rounds (tok/s)")
    print("| prefill | A | B | B / A |\n|---|---|---|---|")
    for key in runs["A"][0]:
        a, b = (statistics.median(s[key] for s in runs[side]) for side in ("A", "B"))
        print(f"| {key} | {a:.0f} | {b:.0f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
