"""Run the engine benchmark on glmserve and its peers, interleaved, in one invocation.

Run it with the project venv (it builds the workloads with the project's transformers/GGUF):

    .venv/bin/python bench/bench_engine.py [--quick] [--only ours,llamacpp,vllm] [--skip transformers]
    .venv/bin/python bench/bench_engine.py --report bench/results/engine-2025-01-01.json
    .venv/bin/python bench/bench_engine.py --only ours,base,vllm --baseline /tmp/main-tree   # A/B against main

`--baseline DIR` adds the runner `base`: our engine from another checkout (`git worktree add DIR main`, or
`git archive main | tar -x -C DIR`), its own bench/ours.py with DIR first on PYTHONPATH, in the same rotation.

Each runner is a separate process started with its own venv's python (peers live under
$GLMSERVE_BENCH_DIR, see setup_peers.sh) in worker mode (harness.py `--worker`). They are started one
after another (startup is measured alone), then stay loaded while the driver asks them for one sample at
a time: for every metric and repeat, each engine in turn, the order rotated per repeat, so load changes on
the shared machine hit every engine alike. While one engine takes a sample the others are stopped (SIGSTOP to
each worker's process group: a peer's server and engine processes too; SIGCONT after), so that an idle
engine's polling threads and timers take no time or cache from the one measured: with every engine on one
core, vLLM's idle processes used ~2% of it and a stand-in that only woke every millisecond slowed our
64-request run by 4.5%. A stopped engine still holds its memory, which slowed the measured one 6-30% on the
2-vCPU VM: `--one-at-a-time` starts, measures and stops each runner before the next instead. A metric's value is
the median of its samples (all kept in
details.samples). Results are merged by engine into bench/results/engine-<date>[-quick].json, and a
markdown table with absolute numbers and ours/peer ratios is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import llama_server
import workloads as wl

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
OURS = "ours"
BASE = "base"  # our engine from the --baseline checkout
LOWER_IS_BETTER = {"prefix_cold_ttft_s", "prefix_warm_ttft_s", "startup_s", "peak_rss_mb"}


@dataclass(frozen=True)
class Runner:
    """One engine: the script to run and the python (venv) to run it with.

    `hf_model`: it runs the exported HF folder, so --peer-dtype applies to it. `tool`: a llama.cpp program it drives.
    """

    key: str
    script: str
    python: Path
    hf_model: bool = False
    tool: str | None = None
    tree: Path | None = None  # another checkout whose bench/ours.py and glmserve run (--baseline)

    def available(self) -> str | None:
        """None when runnable, else why not."""
        if not self.python.exists():
            return f"{self.python} missing: run bench/setup_peers.sh"
        if self.tool and not llama_server.binary(self.tool).exists():
            return f"{self.tool} missing: run bench/setup_peers.sh llama-server"
        if self.hf_model and not (wl.BENCH_DIR / "smollm2-bf16" / "config.json").exists():
            return "exported HF folder missing: run bench/setup_peers.sh export"
        return None


RUNNERS = (
    Runner(OURS, "ours.py", Path(sys.executable)),  # the project venv running this script: the code at HEAD
    # llama-server over HTTP: the project venv's python is the client
    Runner("llamacpp", "peer_llamacpp.py", Path(sys.executable), tool="llama-server"),
    Runner("llamabench", "peer_llamabench.py", Path(sys.executable), tool="llama-bench"),
    Runner("vllm", "peer_vllm.py", wl.BENCH_DIR / "vllm" / "bin" / "python", hf_model=True),
    Runner("transformers", "peer_transformers.py", wl.BENCH_DIR / "transformers" / "bin" / "python", hf_model=True),
)


class Worker:
    """One runner process in worker mode: started, ready, then one sample per `ask`."""

    def __init__(self, runner: Runner, key: str, cmd: list[str], log: Path) -> None:
        self.runner, self.key, self.log = runner, key, log
        print(f"== {key}: {' '.join(cmd)} (log {log})", file=sys.stderr, flush=True)
        self._err = log.open("w")
        env = None
        if runner.tree:  # that checkout's glmserve, not the venv's editable install
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(runner.tree), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(cmd, cwd=runner.tree or REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, text=True, bufsize=1, env=env,
                                     start_new_session=True)  # its own process group, for `hold`
        self.error: str | None = None

    def _line(self, marker: str, timeout_s: float) -> dict[str, Any]:
        """The payload of the next stdout line that starts with `marker` (other output is skipped)."""
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise TimeoutError(f"no {marker.strip()} within {timeout_s:.0f} s (log {self.log})")
            line = self.proc.stdout.readline()
            if not line:
                tail = " | ".join(self.log.read_text().strip().splitlines()[-5:])
                raise RuntimeError(f"exit {self.proc.wait()}, no {marker.strip()}: {tail}"[:2000])
            if line.startswith(marker):
                return json.loads(line[len(marker):])

    def ready(self, timeout_s: float) -> None:
        self._line(harness.READY_MARKER, timeout_s)

    def ask(self, metric: str, index: int, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"metric": metric, "index": index}) + "\n")
        self.proc.stdin.flush()
        return self._line(harness.SAMPLE_MARKER, timeout_s)

    def finish(self, timeout_s: float) -> dict[str, Any]:
        """Ends the worker; its result line (startup, peak RSS, version, notes, details)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"finish": True}) + "\n")
        self.proc.stdin.close()
        return self._line(harness.RESULT_MARKER, timeout_s)

    def hold(self, stopped: bool) -> None:
        """Stops (SIGSTOP) or continues (SIGCONT) every process of this worker's group."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP if stopped else signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.hold(False)
            self.proc.kill()
            self.proc.wait()
        self._err.close()


def worker_command(runner: Runner, work_path: Path, gguf: Path, args: argparse.Namespace) -> list[str]:
    extra = ["--dtype", args.peer_dtype] if args.peer_dtype and runner.hf_model else []
    if args.quantization and runner.key in (OURS, BASE):
        extra += ["--quantization", args.quantization]
    script = (runner.tree / "bench" if runner.tree else BENCH) / runner.script
    return [str(runner.python), str(script), "--workloads", str(work_path), "--gguf", str(gguf),
            "--hf-dir", str(wl.BENCH_DIR / "smollm2-bf16"), *extra, "--worker", "--t0", repr(time.time())]


def result_key(runner: Runner, args: argparse.Namespace) -> str:
    if args.peer_dtype and runner.hf_model:
        return f"{runner.key}:{args.peer_dtype}"
    if args.quantization and runner.key in (OURS, BASE):
        return f"{runner.key}:{args.quantization}"
    return runner.key


def plan(work: wl.Workloads, metrics: list[str], args: argparse.Namespace) -> list[tuple[str, int]]:
    """(metric, sample index) in measuring order (`--metrics`' order, else harness.Suite.ORDER): `--repeats`
    samples each (`--repeats-for` per metric), never more than the workloads hold."""
    steps = []
    for metric in metrics if args.metrics else [m for m in harness.Suite.ORDER if m in metrics]:
        count = args.repeats_for.get(metric, args.repeats)
        steps += [(metric, i) for i in range(min(count, harness.repeats(work, metric)))]
    return steps


def parse_metric_arg(text: str) -> tuple[str, str]:
    metric, sep, value = text.partition("=")
    if not sep or metric not in harness.METRICS:
        raise argparse.ArgumentTypeError(f"want METRIC=VALUE with a metric of harness.METRICS: {text!r}")
    return metric, value


class Run:
    """The interleaved run: workers, their samples and notes, runners still waiting for their program."""

    def __init__(self, work_path: Path, gguf: Path, args: argparse.Namespace) -> None:
        self.work_path, self.gguf, self.args = work_path, gguf, args
        self.results: dict[str, dict[str, Any]] = {}
        self.workers: list[Worker] = []
        self.samples: dict[str, dict[str, list[dict[str, Any]]]] = {}
        self.notes: dict[str, dict[str, str]] = {}

    def start(self, runner: Runner) -> None:
        """Start one runner and wait until it is ready (the others are idle meanwhile)."""
        worker = self.spawn(runner)
        if worker:
            self.ready(worker)

    def spawn(self, runner: Runner) -> Worker | None:
        key = result_key(runner, self.args)
        why_not = runner.available()
        if why_not:
            self.results[key] = {"engine": runner.key, "error": why_not}
            return None
        return Worker(runner, key, worker_command(runner, self.work_path, self.gguf, self.args),
                      wl.BENCH_DIR / "logs" / f"{self.args.out.stem}-{runner.key}.log")  # one set per run

    def ready(self, worker: Worker) -> None:
        key, runner = worker.key, worker.runner
        try:
            worker.ready(self.args.timeout)
        except (TimeoutError, RuntimeError) as exc:
            self.results[key] = {"engine": runner.key, "error": f"startup: {exc}"}
            worker.kill()
            return
        self.workers.append(worker)
        self.samples[key], self.notes[key] = {}, {}

    def wanted(self, runner: Runner, metric: str) -> bool:
        return metric not in self.args.engines_for or runner.key in self.args.engines_for[metric]

    def measure(self, steps: list[tuple[str, int]], pending: list[Runner]) -> None:
        """Every step on every worker, the order rotated per sample index; a pending runner (its llama.cpp
        program still being built) is started before the first step it takes part in, waiting for it until
        `--wait-binary` runs out."""
        deadline = time.monotonic() + self.args.budget if self.args.budget else float("inf")
        give_up = time.monotonic() + self.args.wait_binary
        for n, (metric, index) in enumerate(steps):
            for runner in [r for r in pending if self.wanted(r, metric)]:
                while runner.available() and time.monotonic() < give_up:
                    time.sleep(10)
                pending.remove(runner)
                time.sleep(0 if runner.available() else 10)  # the linker may still be writing it
                self.start(runner)
            stop = self.args.stop_file is not None and self.args.stop_file.exists()
            if (time.monotonic() > deadline or stop) and index == 0:
                why = "--stop-file appeared" if stop else f"the budget ({self.args.budget:.0f} s) ran out"
                for w in self.workers:
                    self.notes[w.key].setdefault(metric, f"skipped: {why}")
                continue
            shift = index % max(1, len(self.workers))
            for w in self.workers[shift:] + self.workers[:shift]:
                if w.error or metric in self.notes[w.key]:
                    continue
                if not self.wanted(w.runner, metric):
                    self.notes[w.key][metric] = "not measured in this run (--engines-for)"
                    continue
                print(f"[{n + 1}/{len(steps)}] {w.key} {metric} #{index}", file=sys.stderr, flush=True)
                try:
                    with self.alone(w):
                        reply = w.ask(metric, index, self.args.timeout)
                except (TimeoutError, RuntimeError) as exc:
                    w.error = str(exc)
                    continue
                if reply["error"]:
                    self.notes[w.key][metric] = reply["error"]
                else:
                    self.samples[w.key].setdefault(metric, []).append(reply)
        for runner in pending:
            self.results[result_key(runner, self.args)] = {"engine": runner.key, "error": "never started: no step"}

    @contextlib.contextmanager
    def alone(self, worker: Worker) -> Iterator[None]:
        """The other workers stopped while `worker` takes a sample."""
        others = [w for w in self.workers if w is not worker]
        for w in others:
            w.hold(True)
        try:
            yield
        finally:
            for w in others:
                w.hold(False)

    def finish(self) -> None:
        for w in self.workers:
            if w.error:
                self.results[w.key] = {"engine": w.runner.key, "error": w.error}
                continue
            try:
                final = w.finish(self.args.timeout)
            except (TimeoutError, RuntimeError) as exc:
                self.results[w.key] = {"engine": w.runner.key, "error": f"finish: {exc}"}
                continue
            got = self.samples[w.key]
            loads = [s["loadavg_1m"] for values in got.values() for s in values]
            final.update({m: round(statistics.median(s["value"] for s in values), 4) for m, values in got.items()})
            final["notes"] = {**final.get("notes", {}), **self.notes[w.key]}
            final["details"]["samples"] = {m: [s["value"] for s in values] for m, values in got.items()}
            final["details"]["loadavg_1m_min_max"] = [min(loads), max(loads)] if loads else None
            self.results[w.key] = {**final, "key": w.runner.key}


def run_interleaved(chosen: list[Runner], work_path: Path, gguf: Path, args: argparse.Namespace
                    ) -> dict[str, dict[str, Any]]:
    """Start every runner (one at a time), then measure sample by sample across them; result per key."""
    work = wl.load(work_path)
    metrics = args.metrics.split(",") if args.metrics else list(harness.METRICS)
    run = Run(work_path, gguf, args)
    pending = [r for r in chosen if args.wait_binary and r.tool and r.available()]
    try:
        if args.parallel_start:  # every runner loads at once: less wall time, startup_s of each inflated
            for worker in [run.spawn(r) for r in chosen if r not in pending]:
                if worker:
                    run.ready(worker)
        else:
            for runner in chosen:
                if runner not in pending:
                    run.start(runner)
        run.measure(plan(work, metrics, args), pending)
        run.finish()
    finally:
        for w in run.workers:
            w.kill()
    return run.results


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
        f"load avg (1 min) {details.get('loadavg_1m_min_max') or details.get('loadavg_1m_start_end')} while "
        f"sampling, {result.get('measured_at')}; samples {details.get('samples')}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller counts (smoke run)")
    parser.add_argument("--only", default="", help="comma-separated runner keys: " + ",".join(r.key for r in RUNNERS)
                        + f" ({BASE} with --baseline)")
    parser.add_argument("--baseline", type=Path, help=f"another checkout of glmserve, measured as runner {BASE!r}")
    parser.add_argument("--skip", default="", help="comma-separated runner keys to leave out")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds a runner may take to start or to measure one sample before it is dropped")
    parser.add_argument("--budget", type=float, help="seconds of measuring after which no new metric starts")
    parser.add_argument("--parallel-start", action="store_true",
                        help="start the runners at once (their startup_s overlap: no startup comparison)")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="start, measure and stop each runner before the next starts, so that no other engine's "
                             "memory is resident while one is measured (on the 2-vCPU VM a stopped process holding "
                             "5.5 GB slowed the measured engine 6-30%%, bench/RESULTS.md); host drift between "
                             "engines is then not spread over them")
    parser.add_argument("--stop-file", type=Path, help="no new metric starts once this file exists")
    parser.add_argument("--repeats", type=int, default=3, help="samples per metric (at most the workloads' repeats)")
    parser.add_argument("--repeats-for", type=parse_metric_arg, action="append", default=[],
                        help="METRIC=N: samples of METRIC (repeat)")
    parser.add_argument("--metrics", help="comma-separated subset of harness.METRICS (default: all)")
    parser.add_argument("--engines-for", type=parse_metric_arg, action="append", default=[],
                        help="METRIC=key,key: measure METRIC on these runners only (repeat)")
    parser.add_argument("--wait-binary", type=float, default=0.0,
                        help="seconds to wait for a llama.cpp program still being built: that runner starts "
                        "before the first metric it takes part in (order them with --metrics)")
    parser.add_argument("--peer-dtype", help="dtype for the transformers/vLLM peers (default bfloat16)")
    parser.add_argument("--gguf", type=Path, help="the GGUF ours and llama.cpp run (default: the embedded SmolLM2 "
                        "Q4_1; another SmolLM2 file, e.g. a Q4_K_M from `bench/setup_peers.sh kquant`, keeps the "
                        "workloads' token ids valid)")
    parser.add_argument("--quantization", help="glmserve's weight format (default: the GGUF's own Q4_1/Q8_0 blocks; "
                        "none: float32, as before the quantized path); results are keyed ours:<format>")
    parser.add_argument("--out", type=Path, help="results JSON (default bench/results/engine-<date>[-quick].json)")
    parser.add_argument("--report", type=Path, help="only print the table of an existing results JSON")
    args = parser.parse_args()

    args.engines_for = {m: set(keys.split(",")) for m, keys in args.engines_for}
    args.repeats_for = {m: int(n) for m, n in args.repeats_for}
    if args.report:
        print(table(json.loads(args.report.read_text())["engines"]))
        return
    only = {k for k in args.only.split(",") if k}
    skip = {k for k in args.skip.split(",") if k}
    runners = list(RUNNERS)
    if args.baseline:
        if not (args.baseline / "bench" / "ours.py").exists():
            parser.error(f"--baseline {args.baseline}: no bench/ours.py there (not a glmserve checkout)")
        runners.insert(1, Runner(BASE, "ours.py", Path(sys.executable), tree=args.baseline.resolve()))
    unknown = (only | skip) - {r.key for r in runners}
    if unknown:
        parser.error(f"unknown runner(s): {', '.join(sorted(unknown))}")
    chosen = [r for r in runners if (not only or r.key in only) and r.key not in skip]

    work_path = wl.ensure(args.quick)
    gguf = args.gguf or wl.embedded_gguf_path()
    date = datetime.date.today().isoformat()
    out = args.out or BENCH / "results" / f"engine-{date}{'-quick' if args.quick else ''}.json"
    args.out = out  # the runners' logs are named after it
    report = json.loads(out.read_text()) if out.exists() else {"engines": {}}
    report.update(
        {
            "date": date,
            "machine": {"cpu": _cpu_model(), "platform": platform.platform()},
            "workloads": work_path.name,
            "quick": args.quick,
        }
    )
    load_start = os.getloadavg()
    groups = [[r] for r in chosen] if args.one_at_a_time else [chosen]
    results = {key: result for group in groups for key, result in run_interleaved(group, work_path, gguf, args).items()}
    for key, result in results.items():
        result["command"] = " ".join(sys.argv)
        result["measured_at"] = datetime.datetime.now().isoformat(timespec="seconds")
        report["engines"][key] = result
    report["loadavg_start_end"] = [list(load_start), list(os.getloadavg())]
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
