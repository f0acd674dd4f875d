"""Where a batched decode step's time goes, by component: the quantized linears by role (QKV, o, gate-up, down,
lm_head), paged decode attention, the rest of the model (norms, rotary, SiLU, residuals, embedding), sampling,
the step's batch building (scheduler, block tables, metadata) and the per-token bookkeeping (detokenization,
stop checks, outputs).

    GLMSERVE_BENCH_THREADS=1 .venv/bin/python bench/profile_decode.py [--batch 32] [--steps 32] [--repeats 3]
        [--clock wall|cpu] [--prompt-len 128]

torch.profiler does not see our C++ kernels (pybind calls, not torch ops: bench/profile_engine.py books them
as "outside ops"), so each component is timed here with perf_counter around its call (module hooks and method
wrappers; one thread, so the sums are exclusive where the components do not nest); `--clock cpu` reads this
thread's CPU time instead of the wall clock, which with one thread is the step's compute whatever else the host
runs (the wait for a preempted core is not counted; memory contention still is). The batch's prompts
(`--prompt-len`, default `DECODE_BATCH_PROMPT_LEN` tokens, bench/workloads.py) are computed before the timed steps;
each request gets enough new tokens that none finishes before the window ends, however many prefill steps the batch
takes (with too few, early requests finished while later ones prefilled, and the window ran a smaller batch). Prints the
median over `--repeats` windows of `--steps` steps of each component's ms per step and share of the step.

Decode steps that qualify run the fused decode path (glmserve/models/llama_decode.py: no module calls inside the
layers), where the linear and attention hooks never fire and the whole forward lands in "model rest"; profile the
module path component by component with GLMSERVE_FUSED_DECODE=0. `--no-components` leaves out the hooks inside the
model (whose cost only the module path pays) for a fair A/B of the two (bench/ab_decode.py passes it through).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import workloads as wl

os.environ.setdefault("OMP_NUM_THREADS", str(wl.THREADS))

ROLES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


class Timers:
    """Seconds per component name, summed over calls, on `clock`."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.total: dict[str, float] = collections.defaultdict(float)
        self._start: dict[int, float] = {}
        self.clock = clock

    def wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += self.clock() - start
        return timed

    def hook_module(self, name: str, module) -> None:
        def pre(mod, args):
            self._start[id(mod)] = self.clock()

        def post(mod, args, out):
            self.total[name] += self.clock() - self._start.pop(id(mod))
        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


def instrument(engine, timers: Timers, components: bool = True) -> None:
    """Wraps the engine's parts in `timers`; `components`: also the model's linears, embedding and attention (hooks
    that cost the module path time the fused decode path never pays)."""
    from glmserve.engine import runner as runner_module
    from glmserve.layers import attention as attention_module
    from glmserve.layers.attention import PagedAttention

    model = engine.runner.model
    timers.hook_module("model forward (all)", model)
    if components:
        for name, module in model.named_modules():
            role = name.rsplit(".", 1)[-1]
            if role in ROLES:
                timers.hook_module(role, module)
        timers.hook_module("embedding", model.embed_tokens)
        PagedAttention.__call__ = timers.wrap("attention (all)", PagedAttention.__call__)
        PagedAttention._decode = timers.wrap("attention: decode kernel", PagedAttention._decode)
        for write in ("store", "store_kv"):  # the KV write as attention calls it (store_kv since bf16 KV)
            if hasattr(attention_module, write):
                setattr(attention_module, write, timers.wrap("attention: KV write", getattr(attention_module, write)))
    runner_module.sample = timers.wrap("sampling", runner_module.sample)
    r = engine.runner
    r._prepare = timers.wrap("batch building (runner._prepare)", r._prepare)
    model.attention_metadata = timers.wrap("attention metadata", model.attention_metadata)
    engine.scheduler.schedule = timers.wrap("scheduler", engine.scheduler.schedule)
    engine._check_stop = timers.wrap("detokenize + stop checks", engine._check_stop)
    engine._output = timers.wrap("request outputs", engine._output)
    engine.step = timers.wrap("engine step (all)", engine.step)


def window(engine, params, prompts: list[list[int]], steps: int, timers: Timers, tag: str) -> dict[str, float]:
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    while not all(s.num_output_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill, outside the window
    timers.total.clear()
    for _ in range(steps):
        if len(engine.scheduler.running) != len(prompts):
            raise RuntimeError(f"{len(engine.scheduler.running)} of {len(prompts)} requests running in the window")
        engine.step()
    ms = {k: v * 1e3 / steps for k, v in timers.total.items()}
    while engine.has_unfinished_requests():
        engine.step()
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=wl.DECODE_BATCH)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=wl.DECODE_BATCH_PROMPT_LEN,
                        help="tokens per prompt (the KV each decode row attends to)")
    parser.add_argument("--json", help="also write {component: ms per step} here (bench/ab_decode.py reads it)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: elapsed time; cpu: this thread's CPU time (one thread: robust to a busy host)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the engine's KV format (default: its auto)")
    parser.add_argument("--model", help="a model path or GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--no-components", action="store_true",
                        help="time only the model's forward and the engine's parts (no hooks inside the model): "
                             "for A/B of the fused decode path against the module path")
    args = parser.parse_args()

    import torch

    from glmserve import LLM, SamplingParams

    torch.set_num_threads(wl.THREADS)
    llm = LLM(model=args.model, num_threads=wl.THREADS, kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.engine
    maker = wl.PromptMaker(wl.load_tokenizer(wl.embedded_gguf_path()), wl.SEED + 5)
    llm.generate([maker.tokens(64)], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
    timers = Timers(CLOCKS[args.clock])
    instrument(engine, timers, components=not args.no_components)
    prefill_steps = -(-args.batch * args.prompt_len // engine.config.max_num_batched_tokens) + 1
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + prefill_steps + 2, ignore_eos=True)
    runs = [window(engine, params, maker.batch(args.batch, args.prompt_len), args.steps, timers, f"w{i}")
            for i in range(args.repeats)]
    median = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}
    step = median["engine step (all)"]
    forward = median["model forward (all)"]
    linears = sum(median.get(r, 0.0) for r in ROLES)
    inside = linears + median.get("attention (all)", 0.0) + median.get("embedding", 0.0)
    if not args.no_components:
        median["model rest (norms, rotary, SiLU, residuals)"] = forward - inside
    outside = sum(median.get(k, 0.0) for k in ("model forward (all)", "sampling", "batch building (runner._prepare)",
                                               "attention metadata", "scheduler", "detokenize + stop checks",
                                               "request outputs"))
    median["engine rest (KV block bookkeeping, Python)"] = step - outside
    print(f"decode batch {args.batch} (prompts of {args.prompt_len} tokens), {args.steps} steps x {args.repeats} "
          f"windows, {torch.get_num_threads()} thread(s), {args.clock} clock: {step:.2f} ms/step = "
          f"{args.batch / step * 1e3:.1f} tok/s; load {os.getloadavg()[0]:.2f}")
    print("| component | ms / step | share of step |")
    print("|---|---|---|")
    for k, v in sorted(median.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {v:.2f} | {v / step:.1%} |")
    if args.json:
        Path(args.json).write_text(json.dumps(median))


if __name__ == "__main__":
    main()
