"""A/B of the fused decode layers (glmserve/models/llama_decode.py) against the module path in one engine,
interleaved: windows of `steps` decode steps of the embedded model alternate between GLMSERVE_FUSED_DECODE unset
(fused) and "0" (the module path), A first on even rounds, B first on odd ones, after a prefill and a warm-up.
Prints each side's median ms per step in this thread's CPU time (robust to a busy host at one thread) and wall
time, and the speed-up.

    taskset -c 0 env GLMSERVE_BENCH_THREADS=1 .venv/bin/python bench/ab_fused_decode.py [--rounds 10] [--steps 32]
        [--batch 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import workloads as wl

os.environ.setdefault("OMP_NUM_THREADS", str(wl.THREADS))

ENV = "GLMSERVE_FUSED_DECODE"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()

    import torch

    from glmserve import LLM, SamplingParams

    torch.set_num_threads(wl.THREADS)
    engine = LLM(model=None, num_threads=wl.THREADS).engine
    params = SamplingParams(temperature=0, max_tokens=2 * args.rounds * args.steps + 40, ignore_eos=True)
    for b in range(args.batch):
        engine.add_request(f"r{b}", list(range(100 + b, 164 + b)), params)
    for _ in range(20):  # the prefill and a warm-up
        engine.step()
    times: dict[str, tuple[list[float], list[float]]] = {"fused": ([], []), "modules": ([], [])}
    for r in range(args.rounds):
        for side in ("fused", "modules") if r % 2 == 0 else ("modules", "fused"):
            if side == "modules":
                os.environ[ENV] = "0"
            else:
                os.environ.pop(ENV, None)
            cpu, wall = time.thread_time(), time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times[side][0].append((time.thread_time() - cpu) / args.steps * 1e3)
            times[side][1].append((time.perf_counter() - wall) / args.steps * 1e3)
    med = {side: (statistics.median(c), statistics.median(w)) for side, (c, w) in times.items()}
    for side, (c, w) in med.items():
        print(f"{side}: {c:.2f} ms/step CPU, {w:.2f} ms/step wall")
    print(f"fused speed-up: {med['modules'][0] / med['fused'][0]:.3f}x CPU, {med['modules'][1] / med['fused'][1]:.3f}x "
          f"wall (medians of {args.rounds}; {wl.THREADS} thread(s), batch {args.batch}, load {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
