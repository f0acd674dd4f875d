"""Run the engine benchmark on glmserve and its peers, one engine after another.

Run it with the project venv (it builds the workloads with the project's transformers/GGUF):

    .venv/bin/python bench/bench_engine.py [--quick] [--only ours,vllm] [--skip transformers]
    .venv/bin/python bench/bench_engine.py --report bench/results/engine-2025-01-01.json

Each runner is a separate process started with its own venv's python (peers live under
$GLMSERVE_BENCH_DIR, see setup_peers.sh); never two at once (the machine has 2 cores). Results
are merged by engine into bench/results/engine-<date>[-quick].json, and a markdown table with
absolute numbers and ours/peer ratios is printed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import workloads as wl

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
OURS = "ours"
LOWER_IS_BETTER = {"prefix_cold_ttft_s", "prefix_warm_ttft_s", "startup_s", "peak_rss_mb"}


@dataclass(frozen=True)
class Runner:
    """One engine: the script to run and the python (venv) to run it with.

    `hf_model`: it runs the exported HF folder, so --peer-dtype applies to it.
    """

    key: str
    script: str
    python: Path
    hf_model: bool = False

    def available(self) -> str | None:
        """None when runnable, else why not."""
        if not self.python.exists():
            return f"{self.python} missing: run bench/setup_peers.sh"
        if self.hf_model and not (wl.BENCH_DIR / "smollm2-bf16" / "config.json").exists():
            return "exported HF folder missing: run bench/setup_peers.sh export"
        return None


RUNNERS = (
    Runner(OURS, "ours.py", Path(sys.executable)),  # the project venv running this script: the code at HEAD
    Runner("llamacpp", "peer_llamacpp.py", wl.BENCH_DIR / "llamacpp" / "bin" / "python"),
    Runner("vllm", "peer_vllm.py", wl.BENCH_DIR / "vllm" / "bin" / "python", hf_model=True),
    Runner("transformers", "peer_transformers.py", wl.BENCH_DIR / "transformers" / "bin" / "python", hf_model=True),
)


def run_one(runner: Runner, work_path: Path, gguf: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Run one runner process; its result dict, or {"engine", "error"} when it failed."""
    extra = ["--dtype", args.peer_dtype] if args.peer_dtype and runner.hf_model else []
    if args.quantization and runner.key == OURS:
        extra += ["--quantization", args.quantization]
    if args.budget:
        extra += ["--budget-s", str(args.budget)]
    if args.metrics:
        extra += ["--metrics", args.metrics]
    why_not = runner.available()
    if why_not:
        return {"engine": runner.key, "error": why_not}
    log = wl.BENCH_DIR / "logs" / f"engine-{runner.key}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(runner.python),
        str(BENCH / runner.script),
        "--workloads",
        str(work_path),
        "--gguf",
        str(gguf),
        "--hf-dir",
        str(wl.BENCH_DIR / "smollm2-bf16"),
        *extra,
        "--t0",
        repr(time.time()),
    ]
    print(f"== {runner.key}: {' '.join(cmd)} (log {log})", file=sys.stderr, flush=True)
    with log.open("w") as err:
        try:
            proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {"engine": runner.key, "error": f"timed out after {args.timeout:.0f}s (log {log})"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(harness.RESULT_MARKER):
            return {**json.loads(line[len(harness.RESULT_MARKER) :]), "key": runner.key}
    tail = " | ".join(log.read_text().strip().splitlines()[-5:])
    return {"engine": runner.key, "error": f"exit {proc.returncode}, no result: {tail}"[:2000]}


def _fmt(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"


def table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown: one row per metric, one column per engine, then ours/peer ratios."""
    keys = [k for k in results if "error" not in results[k]]
    peers = [k for k in keys if k != OURS]
    ratio_cols = [f"ours/{p}" for p in peers] if OURS in keys else []
    lines = ["| metric | " + " | ".join(keys + ratio_cols) + " |", "|---" * (1 + len(keys) + len(ratio_cols)) + "|"]
    for metric in harness.METRICS:
        cells = [_fmt(results[k].get(metric)) for k in keys]
        ours = results.get(OURS, {}).get(metric) if ratio_cols else None
        for peer in peers if ratio_cols else ():
            theirs = results[peer].get(metric)
            unlike = metric in results[peer].get("details", {}).get("unlike", ())  # e.g. a batch run serially
            cells.append(f"{ours / theirs:.2f}×" if ours and theirs and not unlike else "—")
        arrow = " (↓)" if metric in LOWER_IS_BETTER else ""
        lines.append(f"| {metric}{arrow} | " + " | ".join(cells) + " |")
    notes = [f"- {k}: {m}: {n}" for k in keys for m, n in results[k].get("notes", {}).items() if n != "not requested"]
    errors = [f"- {k}: {results[k]['error']}" for k in results if "error" in results[k]]
    versions = [f"- {k}: {results[k].get('version')}; {_conditions(results[k])}" for k in keys]
    return "\n".join(
        lines
        + [
            "",
            "(↓) lower is better; ratios are ours/peer; no ratio where the peer ran the workload unlike us "
            "(its note says how).",
            "",
            "Versions:",
            *versions,
            *(["", "Notes:", *notes] if notes else []),
            *(["", "Failed:", *errors] if errors else []),
        ]
    )


def _conditions(result: dict[str, Any]) -> str:
    details = result.get("details", {})
    return (
        f"{details.get('threads')} thread(s), {'quick' if details.get('quick') else 'full'}, "
        f"load avg {details.get('loadavg_1m_start_end')}, {result.get('measured_at')}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller counts (smoke run)")
    parser.add_argument("--only", default="", help="comma-separated runner keys: " + ",".join(r.key for r in RUNNERS))
    parser.add_argument("--skip", default="", help="comma-separated runner keys to leave out")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per runner before it is killed")
    parser.add_argument("--budget", type=float, help="seconds per runner after which it starts no new metric")
    parser.add_argument("--metrics", help="comma-separated subset of harness.METRICS (default: all)")
    parser.add_argument("--peer-dtype", help="dtype for the transformers/vLLM peers (default bfloat16)")
    parser.add_argument("--quantization", help="glmserve's weight format (default: the GGUF's own Q4_1/Q8_0 blocks; "
                        "none: float32, as before the quantized path); results are keyed ours:<format>")
    parser.add_argument("--out", type=Path, help="results JSON (default bench/results/engine-<date>[-quick].json)")
    parser.add_argument("--report", type=Path, help="only print the table of an existing results JSON")
    args = parser.parse_args()

    if args.report:
        print(table(json.loads(args.report.read_text())["engines"]))
        return
    only = {k for k in args.only.split(",") if k}
    skip = {k for k in args.skip.split(",") if k}
    unknown = (only | skip) - {r.key for r in RUNNERS}
    if unknown:
        parser.error(f"unknown runner(s): {', '.join(sorted(unknown))}")
    chosen = [r for r in RUNNERS if (not only or r.key in only) and r.key not in skip]

    work_path = wl.ensure(args.quick)
    gguf = wl.embedded_gguf_path()
    date = datetime.date.today().isoformat()
    out = args.out or BENCH / "results" / f"engine-{date}{'-quick' if args.quick else ''}.json"
    report = json.loads(out.read_text()) if out.exists() else {"engines": {}}
    report.update(
        {
            "date": date,
            "machine": {"cpu": _cpu_model(), "platform": platform.platform()},
            "workloads": work_path.name,
            "quick": args.quick,
        }
    )
    for runner in chosen:
        result = run_one(runner, work_path, gguf, args)
        result["command"] = " ".join(sys.argv)
        result["measured_at"] = datetime.datetime.now().isoformat(timespec="seconds")
        key = f"{runner.key}:{args.peer_dtype}" if args.peer_dtype and runner.hf_model else runner.key
        if args.quantization and runner.key == OURS:
            key = f"{runner.key}:{args.quantization}"
        report["engines"][key] = result
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report["engines"]))
    print(f"\nwritten: {out}", file=sys.stderr)


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    main()
