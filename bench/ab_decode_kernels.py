"""A/B of two versions of the int8 block kernel (kernels/csrc/quant_matmul.cpp) inside one engine: the batch-32
decode step of the embedded default model (its own Q4_1 / Q8_0 blocks), with every quantized linear and the lm_head
switched between kernel A (compiled from a given source, e.g. main's) and this checkout's (B) window by window, in
one process. Everything else (attention, the rest of the model, Python) is the same code in both windows, so the
difference is the kernels'. Each window: the batch's prompts computed first (outside the timing), then `--steps`
decode steps timed by wall clock and by the process's CPU time (one thread: the work itself, which other processes'
load inflates less than the wall clock). Windows alternate A, B, B, A, ...; medians per side.

    git show main:glmserve/kernels/csrc/quant_matmul.cpp > /tmp/qm_main.cpp
    cd bench && GLMSERVE_BENCH_THREADS=1 ../.venv/bin/python ab_decode_kernels.py /tmp/qm_main.cpp [--windows 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import workloads as wl
from ab_quant_kernels import build_a

os.environ.setdefault("OMP_NUM_THREADS", str(wl.THREADS))


def use_kernel(model, module) -> int:
    """Points every cpu_block weight of `model` at `module`'s quant_linear; returns how many it switched."""
    from glmserve.layers.linear import QuantizedLinear
    from glmserve.quant.cpu_backend import PackedWeight

    switched = 0
    for layer in model.modules():
        if isinstance(layer, QuantizedLinear):
            for segment in layer._segments:
                if isinstance(segment.prepared, PackedWeight):
                    segment.prepared.linear = module.quant_linear
                    switched += 1
    return switched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a_source", type=Path, help="A: a quant_matmul.cpp (e.g. main's)")
    parser.add_argument("--batch", type=int, default=wl.DECODE_BATCH)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--windows", type=int, default=6, help="windows in all, half per side")
    args = parser.parse_args()

    import torch

    from glmserve import LLM, SamplingParams
    from glmserve.kernels.build import load

    torch.set_num_threads(wl.THREADS)
    kernels = {"A": build_a(args.a_source), "B": load("quant_matmul", "avx512")}
    llm = LLM(model=None, num_threads=wl.THREADS)
    engine, model = llm.engine, llm.engine.runner.model
    maker = wl.PromptMaker(wl.load_tokenizer(wl.embedded_gguf_path()), wl.SEED + 5)
    llm.generate([maker.tokens(64)], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 2, ignore_eos=True)
    samples: dict[str, list[tuple[float, float]]] = {"A": [], "B": []}
    print("loadavg before:", Path("/proc/loadavg").read_text().strip())
    for w in range(args.windows):
        side = "AB"[(w + w // 2) % 2]  # A, B, B, A, A, B, ...
        switched = use_kernel(model, kernels[side])
        for i, p in enumerate(maker.batch(args.batch, wl.DECODE_BATCH_PROMPT_LEN)):
            engine.add_request(f"w{w}-{i}", p, params)
        while not all(s.num_output_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()  # prefill, outside the window
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            engine.step()
        wall_ms, cpu_ms = ((time.perf_counter() - start) * 1e3 / args.steps,
                           (time.process_time() - cpu) * 1e3 / args.steps)
        samples[side].append((cpu_ms, wall_ms))
        print(f"window {w + 1} {side} ({switched} weights): CPU {cpu_ms:.1f} ms/step, wall {wall_ms:.1f} ms/step, "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
        while engine.has_unfinished_requests():
            engine.step()
    med = {s: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v)) for s, v in samples.items()}
    for s, (c, w) in med.items():
        print(f"{s}: CPU {c:.1f} ms/step ({args.batch / c * 1e3:.1f} tok/s), wall {w:.1f} ms/step "
              f"({args.batch / w * 1e3:.1f} tok/s)")
    print(f"B / A step time: CPU {med['B'][0] / med['A'][0]:.3f}, wall {med['B'][1] / med['A'][1]:.3f}")
    print("loadavg after:", Path("/proc/loadavg").read_text().strip())


if __name__ == "__main__":
    main()
