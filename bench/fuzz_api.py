"""Fuzzing a running glmserve server from its own OpenAPI schema (schemathesis + hypothesis).

`fuzz(base_url, cases)` sends `cases` requests generated from `/openapi.json`, half fitting the schema and half
not (schemathesis' positive and negative modes: wrong types, huge and negative numbers, missing fields, ...),
to every operation, and checks each answer: a 2xx, or a 4xx whose body is OpenAI's error object; never a 5xx,
never a traceback. It returns the status codes seen and every answer that broke the rule.

    python bench/fuzz_api.py --cases 3000        # a tiny random-weight model on a free loopback port

The command line builds a tiny random Llama (tests/tiny_models.py), serves it with a small context and a
`--max-tokens-cap` (so that each accepted generation is short), fuzzes, and checks that the engine is idle
with every KV block free afterwards; it prints one JSON object (the figures of bench/RESULTS.md "Reliability").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ERROR_FIELDS = {"message", "type", "param", "code"}


@dataclass
class FuzzReport:
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # "METHOD PATH -> STATUS: why", the first few kept
    cases: int = 0

    def add_failure(self, text: str) -> None:
        if len(self.failures) < 20:
            self.failures.append(text)


def check_answer(status: int, body: bytes) -> str | None:
    """Why an answer breaks the rule (None: it does not)."""
    text = body.decode("utf-8", "replace")
    if status >= 500:
        return f"server error {status}: {text[:300]}"
    if "Traceback (most recent call last)" in text:
        return "a traceback in the body"
    if 200 <= status < 300:
        return None
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return f"a {status} whose body is not OpenAI's error object: {text[:300]}"
    if not isinstance(error, dict) or set(error) != ERROR_FIELDS or not error["message"]:
        return f"a {status} with a malformed error object: {text[:300]}"
    return None


def fuzz(base_url: str, cases: int, seed: int = 0, timeout_s: float = 60.0) -> FuzzReport:
    """Sends `cases` generated requests (reproducible for a `seed`) and checks every answer."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    strategy = schema.as_strategy(GenerationMode.POSITIVE) | schema.as_strategy(GenerationMode.NEGATIVE)
    report = FuzzReport()

    @hypothesis_seed(seed)
    @settings(max_examples=cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def one(case: Any) -> None:
        report.cases += 1
        if report.cases % 250 == 0:
            print(f"fuzz: {report.cases} cases, statuses {dict(report.statuses)}", file=sys.stderr, flush=True)
        try:
            response = case.call(base_url=base_url, timeout=timeout_s)
        except Exception as exc:  # the server dropped the connection or hung: as bad as a 5xx
            report.statuses["no answer"] += 1
            report.add_failure(f"{case.method} {case.formatted_path} -> no answer: {type(exc).__name__}: {exc}")
            return
        report.statuses[response.status_code] += 1
        why = check_answer(response.status_code, response.content)
        if why is not None:
            report.add_failure(f"{case.method} {case.formatted_path} -> {why}")

    one()
    return report


def engine_idle(base_url: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """The engine's stats once nothing is in flight and every KV block is free; raises after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        engine = httpx.get(f"{base_url}/v1/health", timeout=10).json()["engine"]
        idle = engine["requests_in_flight"] == 0 and engine["num_running"] == 0 and engine["num_waiting"] == 0
        if idle and engine["num_free_blocks"] == engine["num_total_blocks"]:
            return engine
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine is not idle with every KV block free: {engine}")
        time.sleep(0.1)


# flags of the server the command line (and tests/test_reliability_fuzz.py) fuzzes: a short context, a cap on
# generated tokens, small limits so that their refusals are reached too
FUZZ_SERVER_FLAGS = ["--served-model-name", "tiny", "--max-model-len", "128", "--max-tokens-cap", "4",
                     "--num-threads", "1", "--kv-cache-memory-bytes", str(4 << 20), "--max-num-seqs", "4",
                     "--max-body-bytes", str(1 << 20), "--shutdown-timeout", "5"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", default=None, help="where the server writes its log (default: a temp file)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from serve_process import glmserve
    from tiny_models import make_tiny_chat_model

    os.environ["GLMSERVE_TORCH_ONLY"] = "1"  # the HTTP layer is under test: no C++ kernel to build or load
    with tempfile.TemporaryDirectory(prefix="glmserve-fuzz-") as tmp:
        model = make_tiny_chat_model("llama", Path(tmp) / "model")
        flags = ["--model", str(model), *FUZZ_SERVER_FLAGS, "--session-store", str(Path(tmp) / "sessions")]
        log_path = Path(args.log) if args.log is not None else Path(tmp) / "server.log"
        with glmserve(flags, log_path, ready_timeout_s=300) as base_url:
            start = time.monotonic()
            report = fuzz(base_url, args.cases, args.seed)
            seconds = time.monotonic() - start
            try:
                idle = engine_idle(base_url)
                after = f"idle, {idle['num_free_blocks']}/{idle['num_total_blocks']} blocks free"
            except (AssertionError, httpx.HTTPError) as exc:  # not idle, or the server is gone: a finding
                after = f"{type(exc).__name__}: {exc}"
            log = log_path.read_text(errors="replace")
    print(json.dumps({"cases": report.cases, "seconds": round(seconds, 1),
                      "statuses": {str(k): v for k, v in sorted(report.statuses.items(), key=str)},
                      "failures": report.failures, "tracebacks_in_log": log.count("Traceback"), "after": after,
                      "load_average": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
