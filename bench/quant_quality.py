"""Quantization quality on held-out text, side by side in one run: the float model vs `glmserve quantize`
outputs (RTN, GPTQ, mixed by sensitivity at a bits budget, the seeds' recipe). Each configuration is written as
a compressed-tensors folder, read back, and its layers' weights (dequantized, outlier columns restored) run in
the float model: the reference backend's arithmetic, weight-only (W8A8's activation rounding is not applied).
Weight memory: quantized layers at their bits per weight with 16-bit scales, everything else (embeddings, norms,
outlier columns) at 16 bits, vs all of it in bf16.

  PYTHONPATH=. python bench/quant_quality.py --calib bench/data/calib_en.txt bench/data/calib_zh.txt \\
      --heldout bench/data/heldout_en.txt bench/data/heldout_zh.txt
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from glmserve.cli import run_quantize
from glmserve.models.hf_float import load_float
from glmserve.quant.compressed_tensors import dense_weight, load_checkpoint
from glmserve.quant.perplexity import perplexity, token_windows
from glmserve.quant.pipeline import bits_per_weight, scheme_specs, weight_bytes

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "rtn-w4a16": dict(scheme="w4a16"),
    "gptq-w4a16": dict(scheme="w4a16", method="gptq"),
    "mixed-sensitivity": dict(bits_budget=None, candidates="int8,w4a16-g64"),  # budget: w4a16's bits
    "seeds-recipe": dict(recipe=str(ROOT / "examples/quant/seeds_mixed.yaml")),
    "rtn-int8": dict(scheme="int8"),
}


def _windows(tokenizer, files: list[str], seq_len: int, tokens: int):
    """An equal share of `tokens` from each file (English and Chinese)."""
    return [w for f in files for w in token_windows(tokenizer, Path(f).read_text(encoding="utf-8"), seq_len,
                                                     tokens // len(files))]


@torch.no_grad()
def _ppl_of_checkpoint(model: torch.nn.Module, folder: Path, windows) -> float:
    _, modules, _ = load_checkpoint(folder)
    layers = dict(model.named_modules())
    saved = {n: layers[n].weight.data for n in modules}
    try:
        for n, m in modules.items():
            layers[n].weight.data = dense_weight(m)
        return perplexity(model, windows)
    finally:
        for n, w in saved.items():
            layers[n].weight.data = w


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--calib", nargs="+", required=True)
    p.add_argument("--heldout", nargs="+", required=True)
    p.add_argument("--calib-tokens", type=int, default=1024)
    p.add_argument("--sensitivity-tokens", type=int, default=128, help="calibration tokens of each sensitivity "
                   "loss evaluation (one per layer unit and candidate)")
    p.add_argument("--eval-tokens", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ckpt = load_float(args.model)
    heldout = _windows(ckpt.tokenizer, args.heldout, args.seq_len, args.eval_tokens)
    t0 = time.time()
    base = perplexity(ckpt.model, heldout)
    _, bf16 = weight_bytes(ckpt.model, None)
    rows = [{"config": "float32", "ppl": base, "ppl_increase": 0.0, "weights_mib": bf16 / 2**20,
             "vs_bf16": 0.0, "seconds": time.time() - t0}]
    print(f"float32: ppl {base:.4f} on {sum(w.shape[1] for w in heldout)} held-out tokens", flush=True)
    hidden = ckpt.model.config.hidden_size
    for name in args.configs.split(","):
        options = dict(CONFIGS[name])
        calib_tokens = args.calib_tokens
        if "bits_budget" in options:  # the same budget as uniform w4a16 on the model's input width
            options["bits_budget"] = bits_per_weight(scheme_specs("w4a16")[0], hidden)
            calib_tokens, options["seq_len"] = args.sensitivity_tokens, args.sensitivity_tokens
        t0 = time.time()
        with tempfile.TemporaryDirectory() as out:
            _, result = run_quantize(ckpt, out, calib=args.calib, calib_tokens=calib_tokens, **options)
            ppl = _ppl_of_checkpoint(ckpt.model, Path(out), heldout)
        served, _ = weight_bytes(ckpt.model, result)
        counts: dict[str, int] = {}
        for s in result.schemes.values():
            counts[s] = counts.get(s, 0) + 1
        row = {"config": name, "ppl": ppl, "ppl_increase": ppl / base - 1, "weights_mib": served / 2**20,
               "vs_bf16": 1 - served / bf16, "layers": counts, "seconds": time.time() - t0,
               "budget": options.get("bits_budget"), "notes": result.notes}
        rows.append(row)
        print(f"{name}: ppl {ppl:.4f} ({row['ppl_increase']:+.2%}), weights {row['weights_mib']:.1f} MiB "
              f"({row['vs_bf16']:.1%} below bf16), layers {counts}, {row['seconds']:.0f} s", flush=True)
    print("\n| config | held-out ppl | vs float32 | weight MiB | below bf16 |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['ppl']:.3f} | {r['ppl_increase']:+.2%} | {r['weights_mib']:.1f} | "
              f"{r['vs_bf16']:.1%} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
