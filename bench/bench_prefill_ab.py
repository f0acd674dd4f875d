"""A/B of an environment switch on our engine's prefill and decode, interleaved in one process.

    GLMSERVE_BENCH_THREADS=1 .venv/bin/python bench/bench_prefill_ab.py \
        --env GLMSERVE_BF16_ATTENTION=0,GLMSERVE_BF16_ACTIVATIONS=0 [--prefill 512,2048,8192] [--repeats 3] \
        [--decode-steps 16] [--no-decode] [--clock cpu]

Loads the embedded default model once (engine defaults), then per round and per setting (A: the
environment variables set as given, B: unset; the order alternates by round) runs one fresh prompt of
each `--prefill` length with 1 new token (tok/s = prompt tokens / latency), decode batch 1 (one 512-token
request) and decode batch 32 (32 requests of 128 tokens), each timed over `--decode-steps` steps after
every request has its first token (left out with `--no-decode`). Prints the medians, B / A ratios, the
load average before and after, and the process's peak RSS. Only switches read at call time (as
GLMSERVE_BF16_ATTENTION) can be compared this way. `--clock cpu` times with the process's CPU time instead of the
wall clock: on a machine shared with other work (1 thread), time slices lost to other processes then do not
count, only the work itself (and what sharing the caches costs it).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import workloads as wl

os.environ.setdefault("OMP_NUM_THREADS", str(wl.THREADS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", required=True, help="NAME=VALUE[,NAME=VALUE...]: setting A (B: all unset)")
    parser.add_argument("--prefill", default="512,2048,8192")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--no-decode", action="store_true")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: time.perf_counter; cpu: time.process_time (this process's CPU time)")
    args = parser.parse_args()
    setting_a = dict(item.split("=", 1) for item in args.env.split(","))
    lengths = [int(n) for n in args.prefill.split(",") if n]

    import torch

    from glmserve import LLM, SamplingParams

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(wl.THREADS)
    llm = LLM(model=None, num_threads=wl.THREADS)
    engine = llm.engine
    maker = wl.PromptMaker(wl.load_tokenizer(wl.embedded_gguf_path()), wl.SEED + 11)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([maker.tokens(200)], one)  # warm-up: lazy init, kernels, the bf16 scratch

    def prefill(n: int) -> float:
        prompt = maker.tokens(n - 1 if n >= wl.MODEL_CONTEXT else n)
        start = clock()
        llm.generate([prompt], one)
        return len(prompt) / (clock() - start)

    def decode(batch: int, prompt_len: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps + 2, ignore_eos=True)
        for i, p in enumerate(maker.batch(batch, prompt_len)):
            engine.add_request(f"ab-{time.monotonic_ns()}-{i}", p, params)
        while not all(s.num_output_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        start = clock()
        for _ in range(args.decode_steps):
            engine.step()
        rate = batch * args.decode_steps / (clock() - start)
        while engine.has_unfinished_requests():
            engine.step()
        return rate

    metrics = {f"prefill_{n}_tok_s": (lambda n=n: prefill(n)) for n in lengths}
    if not args.no_decode:
        metrics["decode_b1_tok_s"] = lambda: decode(1, wl.DECODE_PROMPT_LEN)
        metrics["decode_b32_tok_s"] = lambda: decode(wl.DECODE_BATCH, wl.DECODE_BATCH_PROMPT_LEN)
    results: dict[tuple[str, str], list[float]] = {}
    print(f"load average before: {os.getloadavg()}")
    for r in range(args.repeats):
        for setting in (("A", "B") if r % 2 == 0 else ("B", "A")):
            for name, value in setting_a.items():
                if setting == "A":
                    os.environ[name] = value
                else:
                    os.environ.pop(name, None)
            for metric, fn in metrics.items():
                results.setdefault((metric, setting), []).append(fn())
                print(f"round {r} {setting} {metric} {results[metric, setting][-1]:.1f}", flush=True)
    for name in setting_a:
        os.environ.pop(name, None)
    print(f"load average after: {os.getloadavg()}")
    print(f"\n| metric | A: {args.env} | B: unset | B / A |\n|---|---|---|---|")
    for metric in metrics:
        a, b = (statistics.median(results[metric, s]) for s in ("A", "B"))
        print(f"| {metric} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    print(f"\npeak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
