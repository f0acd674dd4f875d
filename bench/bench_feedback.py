"""The serving feedback loop, measured: planted PII and canaries sent through real servers, then `data feedback`.

    PYTHONPATH=. .venv/bin/python bench/bench_feedback.py [--per-type 20] [--canaries 20] [--out results.json]

Two `glmserve serve` processes on the same tiny random chat model (so the HTTP layer and the log dominate, the
worst case for the log's overhead): A without and B with `--log-interactions`. Every request goes to both, in
alternating order, and the medians of their latencies are compared (ratio B/A). The messages carry the PII
of glmserve/data/corpus.py's planted corpus (resident IDs, bank cards, e-mails, phones, IPs) in the user turn,
and three kinds of canary the rules must keep out of the training output: answers cut by max_tokens (low
confidence), answers rated -1 through POST /v1/feedback, conversations the training set already holds. Then
`data feedback` runs over B's logs: leaked PII (a planted value, with or without its spaces, in any output
file), canaries in kept.jsonl, tiers and reasons, answers per second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
STOP = ["e", "o"]  # the tiny model's greedy answers reach one of these within a few tokens (finish "stop")
FLAGS = ["--served-model-name", "tiny", "--max-model-len", "256", "--num-threads", "1",
         "--kv-cache-memory-bytes", str(4 << 20), "--shutdown-timeout", "5"]


def _requests(per_type: int, canaries: int) -> list[dict]:
    from glmserve.data.corpus import build_pii_corpus

    planted = [r for r in build_pii_corpus(seed=7, per_type=per_type) if r["planted"]]
    out = [{"kind": "pii", "text": r["text"], "value": r["planted"]["value"]} for r in planted]
    for i in range(canaries):
        out += [{"kind": "low", "text": f"Explain CANARY-LOW-{i:04d}.", "canary": f"CANARY-LOW-{i:04d}"},
                {"kind": "down", "text": f"What is CANARY-DOWN-{i:04d}?", "canary": f"CANARY-DOWN-{i:04d}"},
                {"kind": "train", "text": f"Repeat CANARY-TRAIN-{i:04d}.", "canary": f"CANARY-TRAIN-{i:04d}"}]
    return out


def _send(http: httpx.Client, req: dict) -> tuple[float, dict]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": req["text"]}], "temperature": 0,
            "max_tokens": 2 if req["kind"] == "low" else 12, "stop": None if req["kind"] == "low" else STOP}
    t0 = time.perf_counter()
    response = http.post("/v1/chat/completions", json=body)
    seconds = time.perf_counter() - t0
    response.raise_for_status()
    return seconds, response.json()


def run(per_type: int, canaries: int, work: Path) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "bench"))
    from serve_process import glmserve
    from tiny_models import make_tiny_chat_model

    from glmserve.data.feedback import feedback
    from glmserve.data.records import write_records

    os.environ["GLMSERVE_TORCH_ONLY"] = "1"
    model = make_tiny_chat_model("llama", work / "model")
    requests = _requests(per_type, canaries)
    logs = work / "logs"
    latency: dict[str, list[float]] = {"off": [], "on": []}
    answers: list[tuple[dict, dict]] = []
    with glmserve(["--model", str(model), *FLAGS], work / "a.log", 300) as url_a, \
            glmserve(["--model", str(model), *FLAGS, "--log-interactions", str(logs)], work / "b.log", 300) as url_b, \
            httpx.Client(base_url=url_a, timeout=120) as a, httpx.Client(base_url=url_b, timeout=120) as b:
        for warm in range(3):
            _send(a, requests[warm]), _send(b, requests[warm])
        for i, req in enumerate(requests):  # alternate which server goes first
            order = [("off", a), ("on", b)] if i % 2 == 0 else [("on", b), ("off", a)]
            for name, client in order:
                seconds, answer = _send(client, req)
                latency[name].append(seconds)
                if name == "on":
                    answers.append((req, answer))
        for req, answer in answers:
            if req["kind"] == "down":
                b.post("/v1/feedback", json={"id": answer["id"], "rating": -1}).raise_for_status()
        time.sleep(1.0)  # the writer thread flushes after each batch
    logged = {json.loads(line)["id"]: json.loads(line) for f in sorted(logs.glob("*.jsonl"))
              for line in f.read_text().splitlines() if '"type": "interaction"' in line}
    train = [{"id": f"t{i}", "text": f"Training document {i} on topic {i * 3} with some words."} for i in range(400)]
    for req, answer in answers:
        if req["kind"] == "train":
            line = logged[answer["id"]]
            train.append({"id": answer["id"], "messages": [*line["messages"], {"role": "assistant",
                                                                               "content": line["choices"][0]["text"]}]})
    write_records(work / "train.jsonl", train)
    t0 = time.perf_counter()
    report = feedback(logs, work / "out", train_sets=[str(work / "train.jsonl")], progress=False)
    seconds = time.perf_counter() - t0
    files = {n: (work / "out" / n).read_text() for n in ("kept.jsonl", "rejected.jsonl", "report.json")}
    everything = "".join(files.values())
    pii = [r for r in requests if r["kind"] == "pii"]
    leaked = [r["value"] for r in pii if r["value"] in everything or r["value"].replace(" ", "") in everything]
    canary_kept = [r["canary"] for r in requests if "canary" in r and r["canary"] in files["kept.jsonl"]]
    med_off, med_on = statistics.median(latency["off"]), statistics.median(latency["on"])
    return {
        "requests": len(requests), "planted_pii": len(pii), "canaries": len(requests) - len(pii),
        "leaked_pii": len(leaked), "leaked_values": leaked[:10], "canaries_in_training_output": len(canary_kept),
        "kept": report["kept"], "tiers": report["tiers"], "rejected_by_reason": report["rejected_by_reason"],
        "pii_found": report["pii_found"], "feedback_seconds": round(seconds, 2),
        "answers_per_second": round(report["candidates"] / seconds, 1),
        "latency_median_ms": {"log_off": round(med_off * 1000, 1), "log_on": round(med_on * 1000, 1)},
        "latency_ratio_on_off": round(med_on / med_off, 3), "load_average": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-type", type=int, default=20, help="planted values per PII type")
    parser.add_argument("--canaries", type=int, default=20, help="canaries of each kind")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="glmserve-feedback-") as tmp:
        result = run(args.per_type, args.canaries, Path(tmp))
    text = json.dumps(result, indent=1, ensure_ascii=False)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
