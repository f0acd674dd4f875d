"""Pictures of bench_engine.py runs for bench/RESULTS.md (SVG, written to bench/plots/).

    .venv/bin/pip install -e '.[bench]'   # matplotlib
    .venv/bin/python bench/plot_results.py ratios --run "1 thread=R1.json" --run "2 threads=R2.json" \
        --out bench/plots/peers-amx.svg
    .venv/bin/python bench/plot_results.py gguf --run R_Q4_K_M.json --run R_Q6_K.json ... --out bench/plots/gguf-b1.svg
    .venv/bin/python bench/plot_results.py quality --run "rotated=R.json" --run U.json --out bench/plots/tune.svg

`ratios`: for every metric a run measured on ours and a peer, how many times better ours is (ours / peer for speeds,
peer / ours where lower is better), one bar per run, with issue 12's target for the metric marked. `gguf`: runs of
`bench_engine.py --only ours,llamacpp --gguf F` (and `base` with `--baseline DIR`): ours', llama.cpp's (and the
baseline checkout's) decode batch 1 per file. `quality`: rows of `quant_quality.py --json` runs (every configuration
but the float ones): held-out and calibration-text perplexity increase over the run's float model, one bar each.
Only what the JSONs hold is drawn; a metric a run lacks has no bar.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import harness
from bench_engine import BASE, LOWER_IS_BETTER, OURS

# issue 12's targets (ours / peer) by metric, and the peer each is against
TARGETS = {"decode_b1_tok_s": ("llamacpp", 1.2), "decode_b32_tok_s": ("vllm", 1.5),
           "throughput_64_tok_s": ("vllm", 1.5), "prefill_512_tok_s": ("vllm", 1.0),
           "prefill_2048_tok_s": ("vllm", 1.0), "prefill_8192_tok_s": ("vllm", 1.0)}
PEER_NAMES = {"vllm": "vLLM-CPU", "llamacpp": "llama.cpp", "transformers": "transformers", "llamabench": "llama-bench"}


def load_run(spec: str) -> tuple[str, dict[str, Any]]:
    """'LABEL=PATH' or 'PATH' -> (label, the run's engines); the label defaults to the file's name."""
    label, _, path = spec.rpartition("=")
    return label or Path(path).stem, json.loads(Path(path).read_text())["engines"]


def advantages(engines: dict[str, Any]) -> dict[tuple[str, str], float]:
    """{(metric, peer): how many times better ours is} for every workload metric (speeds and TTFTs; not startup or
    memory, whose ratios against vLLM's 70 s start would flatten the rest) measured on ours and that peer."""
    ours = engines.get(OURS, {})
    out = {}
    for peer, result in engines.items():
        if peer == OURS or "error" in result:
            continue
        unlike = set(result.get("details", {}).get("unlike", ()))
        for metric in (m for m in harness.METRICS if m not in ("startup_s", "peak_rss_mb")):
            a, b = ours.get(metric), result.get(metric)
            if a and b and metric not in unlike:
                out[(metric, peer)] = b / a if metric in LOWER_IS_BETTER else a / b
    return out


def plot_ratios(runs: list[tuple[str, dict[str, Any]]], out: Path) -> None:
    import matplotlib.pyplot as plt

    per_run = [(label, advantages(engines)) for label, engines in runs]
    rows = list(dict.fromkeys(k for _, adv in per_run for k in adv))  # first-seen order
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(rows) * max(1, len(runs)) + 1.2))
    height = 0.8 / len(runs)
    for i, (label, adv) in enumerate(per_run):
        ys = [r - 0.4 + height * (i + 0.5) for r, key in enumerate(rows) if key in adv]
        xs = [adv[key] for key in rows if key in adv]
        ax.barh(ys, xs, height=height * 0.9, label=label)
        for y, x in zip(ys, xs):
            ax.text(x + 0.02, y, f"{x:.2f}x", va="center", fontsize=8)
    for r, (metric, peer) in enumerate(rows):
        if TARGETS.get(metric, (None,))[0] == peer:
            target = TARGETS[metric][1]
            ax.plot([target, target], [r - 0.45, r + 0.45], color="black", linestyle="--", linewidth=1)
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.set_yticks(range(len(rows)), [f"{m} vs {PEER_NAMES.get(p, p)}" for m, p in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("times better than the peer (ours / peer; peer / ours where lower is better);\n"
                  "dashed: issue 12's target")
    ax.legend(fontsize=8, loc="lower right")
    _save(fig, out)


def gguf_file(engines: dict[str, Any]) -> str:
    """The GGUF a run measured: its command's --gguf (the embedded file without one)."""
    match = re.search(r"--gguf[ =](\S+)", engines.get(OURS, {}).get("command", ""))
    return Path(match.group(1)).name if match else "embedded Q4_1"


def plot_gguf(runs: list[tuple[str, dict[str, Any]]], out: Path) -> None:
    import matplotlib.pyplot as plt

    names = [gguf_file(engines).removesuffix(".gguf") for _, engines in runs]
    fig, ax = plt.subplots(figsize=(1.3 * len(runs) + 2, 3.6))
    series = [(key, label) for key, label in ((BASE, "glmserve before (--baseline)"), (OURS, "glmserve"),
                                              ("llamacpp", "llama.cpp (llama-server)"))
              if any(engines.get(key, {}).get("decode_b1_tok_s") for _, engines in runs)]
    width = 0.8 / len(series)
    for n, (key, label) in enumerate(series):
        values = [engines.get(key, {}).get("decode_b1_tok_s") or 0 for _, engines in runs]
        bars = ax.bar([i + (n - (len(series) - 1) / 2) * width for i in range(len(runs))], values, width=width * 0.95,
                      label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(runs)), names, fontsize=8)
    ax.set_ylabel("decode batch 1, tok/s (1 thread)")
    ax.legend(fontsize=8)
    _save(fig, out)


def quality_rows(spec: str) -> list[tuple[str, dict[str, float]]]:
    """'LABEL=PATH' or 'PATH' of a quant_quality.py JSON -> [(row label, {split: perplexity increase in %})] of its
    quantized rows (the float reference rows left out); the label prefixes each configuration's name."""
    label, _, path = spec.rpartition("=")
    rows = json.loads(Path(path).read_text())
    return [(f"{label}: {r['config']}" if label else r["config"], {k: 100 * v for k, v in r["increase"].items()})
            for r in rows if not r["config"].startswith("float32")]


def plot_quality(rows: list[tuple[str, dict[str, float]]], out: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.4))
    splits = (("heldout", "held-out text"), ("calib", "'calib' column (--calib-eval text, else --calib)"))
    height = 0.8 / len(splits)
    for n, (key, name) in enumerate(splits):
        ys = [i - 0.4 + height * (n + 0.5) for i in range(len(rows))]
        bars = ax.barh(ys, [inc.get(key, 0.0) for _, inc in rows], height=height * 0.9, label=name)
        ax.bar_label(bars, fmt="%+.2f%%", fontsize=7, padding=2)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("perplexity increase over the float model, %")
    ax.legend(fontsize=8, loc="lower right")
    _save(fig, out)


def _save(fig: Any, out: Path) -> None:
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, metadata={"Date": None})  # no timestamp: the same runs give the same file
    plt.close(fig)
    print(f"written: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("ratios", "gguf", "quality"))
    parser.add_argument("--run", action="append", required=True, help="[LABEL=]a bench_engine.py results JSON "
                        "(quality: a quant_quality.py --json file)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "glmserve"  # stable element ids
    if args.kind == "quality":
        plot_quality([row for spec in args.run for row in quality_rows(spec)], args.out)
        return
    runs = [load_run(spec) for spec in args.run]
    (plot_ratios if args.kind == "ratios" else plot_gguf)(runs, args.out)


if __name__ == "__main__":
    main()
