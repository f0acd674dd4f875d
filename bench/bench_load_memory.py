"""Weight bytes and process RSS after loading a model, float vs its native (or another) quantization: each
variant in a fresh process, since RSS only grows.

    PYTHONPATH=. python bench/bench_load_memory.py [--model PATH] [--variants none native w8a8 ...]

"native" = no --quantization (the checkpoint's own format: the embedded GGUF's Q4_1 / Q8_0 blocks).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def measure(model: str | None, variant: str) -> dict:
    import torch

    from glmserve.models.loader import load_model
    from glmserve.models.quantized import weight_bytes

    before = _rss_mb()
    loaded = load_model(model, None, torch.device("cpu"), torch.float32, None if variant == "native" else variant)
    return {"variant": variant, "weight_MB": round(weight_bytes(loaded.model) / 2**20, 1),
            "rss_after_imports_MB": round(before), "rss_after_load_MB": round(_rss_mb()),
            "peak_rss_MB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    parser.add_argument("--variants", nargs="+", default=["none", "native"])
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process's variant
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.model, args.one)))
        return
    for variant in args.variants:
        cmd = [sys.executable, __file__, "--one", variant] + (["--model", args.model] if args.model else [])
        print(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
