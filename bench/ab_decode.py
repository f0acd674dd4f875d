"""A/B of the batch-32 decode step between two checkouts, interleaved: bench/profile_decode.py runs in a fresh
process per sample, alternating A and B (A first on odd rounds, B first on even ones), each on its own
checkout's code (PYTHONPATH) with the same interpreter and thread count. Prints per component the median ms
per step of each side, B / A time ratios and the step's tok/s ratio, with the 1-minute load average of each
sample. `--clock cpu` (the default) times each component in the stepping thread's CPU time, which with one
thread stays the step's compute on a busy host; `--clock wall` the elapsed time.

    GLMSERVE_BENCH_THREADS=1 .venv/bin/python bench/ab_decode.py --a /work/main --b . [--rounds 3] [--steps 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def sample(checkout: Path, steps: int, batch: int, clock: str, components: bool,
           model: str | None) -> tuple[dict[str, float], float]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        extra = ([] if components else ["--no-components"]) + (["--model", model] if model else [])
        subprocess.run([sys.executable, str(HERE / "profile_decode.py"), "--steps", str(steps), "--batch", str(batch),
                        "--repeats", "1", "--json", out.name, "--clock", clock, *extra], env=env, cwd=HERE,
                       check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text()), os.getloadavg()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, required=True, help="checkout A (the baseline)")
    parser.add_argument("--b", type=Path, required=True, help="checkout B")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--no-components", action="store_true",
                        help="no timing hooks inside the model (profile_decode.py): where one side runs the fused "
                             "decode path, the hooks only cost the other")
    parser.add_argument("--model", help="a model path or GGUF file for both sides (default: the embedded SmolLM2)")
    args = parser.parse_args()
    checkouts = {"A": args.a.resolve(), "B": args.b.resolve()}  # the samples run in bench/: relative paths break
    runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for r in range(args.rounds):
        order = ("A", "B") if r % 2 == 0 else ("B", "A")
        for side in order:
            ms, load = sample(checkouts[side], args.steps, args.batch, args.clock, not args.no_components, args.model)
            runs[side].append(ms)
            print(f"round {r + 1} {side}: {ms['engine step (all)']:.1f} ms/step, load {load:.2f}", flush=True)
    med = {side: {k: statistics.median(m.get(k, 0.0) for m in ms) for k in ms[0]} for side, ms in runs.items()}
    step_a, step_b = med["A"]["engine step (all)"], med["B"]["engine step (all)"]
    print(f"\nbatch {args.batch}: A {args.batch / step_a * 1e3:.1f} tok/s, B {args.batch / step_b * 1e3:.1f} tok/s, "
          f"B / A {step_a / step_b:.2f}x (medians of {args.rounds}, {args.clock} clock)")
    print("| component | A ms / step | B ms / step | B / A time |")
    print("|---|---|---|---|")
    for k in sorted(med["A"], key=lambda k: -med["A"][k]):
        a, b = med["A"][k], med["B"].get(k, 0.0)
        print(f"| {k} | {a:.2f} | {b:.2f} | {b / a:.2f} |" if a else f"| {k} | {a:.2f} | {b:.2f} | - |")


if __name__ == "__main__":
    main()
