"""Startup and memory of the servers: launch -> readiness 200, and peak RSS idle and under a small load.

Run with the project venv:

    .venv/bin/python bench/bench_startup.py [--server ours,llamacpp] [--repeats 3] [--clients 4]

Each server (bench_http.py's launchers: ours `glmserve serve` on the embedded model, llama.cpp's
`llama-server` on the same GGUF when setup_peers.sh built it) is launched `--repeats` times, one
at a time. Per launch:
  ready_s        process start -> its readiness route answers 200 (ours /v1/health: model loaded
                 and warmed up; llama-server /health), polled every 20 ms
  idle_rss_mb    summed RSS of the server's process tree 1 s after ready
  load_peak_mb   the peak of that sum (sampled every 50 ms) and of the server's VmHWM while
                 `--clients` streaming chats of ~24 prompt tokens and 64 new tokens run at once
Medians over the launches are printed side by side with ours/peer ratios (lower is better).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import bench_http as bh
import harness
import httpx
import workloads as wl

BENCH = Path(__file__).resolve().parent
METRICS = ("ready_s", "idle_rss_mb", "load_peak_mb")
IDLE_SETTLE_S = 1.0


async def small_load(base_url: str, prompts: list[str]) -> list[bh.RequestStat]:
    """All prompts at once as streaming chats (64 new tokens each)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=bh.REQUEST_TIMEOUT_S) as client:
        model = (await client.get("/models")).json()["data"][0]["id"]
        return list(await asyncio.gather(*(bh.stream_chat(client, model, p, 64) for p in prompts)))


def one_launch(key: str, prompts: list[str], log: Path) -> dict[str, Any]:
    with bh.launched(key, log, "float32", poll_s=0.02) as server:
        time.sleep(IDLE_SETTLE_S)
        idle_kb = harness.tree_rss_kb(server.proc.pid)
        with harness.TreeRssSampler(interval_s=0.05, pid=server.proc.pid) as sampler:
            stats = asyncio.run(small_load(server.base_url, prompts))
        errors = [s.error for s in stats if s.error]
        if errors:
            raise RuntimeError(f"{len(errors)} of {len(stats)} load requests failed: {errors[0]}")
        peak_kb = max(sampler.peak_kb, harness.hwm_kb(server.proc.pid))
        return {
            "ready_s": round(server.ready_s, 3),
            "idle_rss_mb": round(idle_kb / 1024, 1),
            "load_peak_mb": round(peak_kb / 1024, 1),
            "load_tokens": sum(s.output_tokens for s in stats),
            "command": server.command,
        }


def measure(key: str, repeats: int, prompts: list[str]) -> dict[str, Any]:
    runs = []
    for i in range(repeats):
        runs.append(one_launch(key, prompts, wl.BENCH_DIR / "logs" / f"startup-{key}-{i}.log"))
        print(f"  {key} launch {i + 1}: {runs[-1]}", file=sys.stderr, flush=True)
    loads = (round(os.getloadavg()[0], 2),)
    return {
        **{m: statistics.median(r[m] for r in runs) for m in METRICS},
        "runs": runs,
        "command": runs[0]["command"],
        "loadavg_1m_end": loads[0],
    }


def table(results: dict[str, dict[str, Any]]) -> str:
    keys = [k for k in results if "error" not in results[k]]
    peers = [k for k in keys if k != "ours"] if "ours" in keys else []
    lines = [
        "| metric (↓) | " + " | ".join(keys + [f"ours/{p}" for p in peers]) + " |",
        "|---" * (1 + len(keys) + len(peers)) + "|",
    ]
    for metric in METRICS:
        cells = [f"{results[k][metric]:,.2f}" for k in keys]
        cells += [f"{results['ours'][metric] / results[p][metric]:.2f}×" for p in peers]
        lines.append(f"| {metric} | " + " | ".join(cells) + " |")
    lines += ["", "Medians of launches; lower is better. Commands:"]
    lines += [f"- {k}: `{results[k]['command']}`" for k in keys]
    lines += [f"- {k}: failed: {results[k]['error']}" for k in results if "error" in results[k]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="ours,llamacpp", help="comma-separated: ours,llamacpp,vllm")
    parser.add_argument("--repeats", type=int, default=3, help="launches per server (medians are reported)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent requests of the small load")
    parser.add_argument("--out", type=Path, help="results JSON (default bench/results/startup-<date>.json)")
    args = parser.parse_args()
    keys = [k for k in args.server.split(",") if k]
    unknown = set(keys) - set(bh.SERVERS)
    if unknown:
        parser.error(f"unknown server(s): {', '.join(sorted(unknown))}")
    maker = wl.PromptMaker(wl.load_tokenizer(wl.embedded_gguf_path()), wl.SEED + 2)
    prompts = [maker.text(24) for _ in range(args.clients)]
    results: dict[str, dict[str, Any]] = {}
    for key in keys:
        if key == "llamacpp" and not (wl.BENCH_DIR / "bin" / "llama-server").exists():
            results[key] = {"error": "bin/llama-server missing: run bench/setup_peers.sh llama-server"}
            continue
        try:
            results[key] = measure(key, args.repeats, prompts)
        except Exception as exc:  # one failing server must not lose the others' results
            results[key] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    date = datetime.date.today().isoformat()
    out = args.out or BENCH / "results" / f"startup-{date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"date": date, "threads": wl.THREADS, "clients": args.clients, "servers": results,
              "command": " ".join(sys.argv)}
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(results))
    print(f"\nwritten: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
