"""Greedy chat answers of llama.cpp and glmserve on the same GGUF, side by side.

    .venv/bin/python bench/bench_chat_agreement.py [--config default:"" --config none:"--quantization none"] \
        [--max-tokens 32] [--threads 1] [--prompt "..."]...

One `glmserve serve` per `--config NAME:FLAGS` and `llama-server` (bench/setup_peers.sh llama-server) answer
the same user messages through `/v1/chat/completions` with the model's own chat template (the GGUF's), at
temperature 0 with `logprobs`/`top_logprobs: 3`. Printed per prompt and engine: the answer, the three most
likely first tokens with their logprobs (a near tie there decides a greedy answer), and the prompt's token
count (llama-server's `usage.prompt_tokens` and ours: the two chat templates and tokenizers must agree).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import llama_server  # noqa: E402
import workloads as wl  # noqa: E402
from serve_process import glmserve  # noqa: E402

PROMPTS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 7?",
    "Write one sentence about the sea.",
    "Translate 'good morning' into Spanish.",
)
LLAMACPP = "llama.cpp"


def ask(base_url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One greedy chat completion: answer, first-token alternatives, prompt token count."""
    model = httpx.get(f"{base_url}/v1/models", timeout=60).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "logprobs": True, "top_logprobs": 3}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    data = response.json()
    choice = data["choices"][0]
    first = (choice.get("logprobs") or {}).get("content") or [{}]
    tops = [(t["token"], round(t["logprob"], 3)) for t in first[0].get("top_logprobs", [])]
    return {"answer": choice["message"]["content"], "first_token_top3": tops,
            "prompt_tokens": data["usage"]["prompt_tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", default=[], help='NAME:"glmserve serve flags" (repeat)')
    parser.add_argument("--prompt", action="append", default=[], help="user message (repeat; default: 5 fixed)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=wl.THREADS)
    parser.add_argument("--json", type=Path, help="write the answers here too")
    parser.add_argument("--ready-timeout", type=float, default=900, help="seconds for a glmserve serve to get ready")
    parser.add_argument("--wait-llamacpp", type=float, default=0.0,
                        help="seconds to wait for llama-server to be built, after asking ours")
    args = parser.parse_args()
    configs = [c.partition(":")[::2] for c in args.config] or [("default", ""), ("none", "--quantization none")]
    prompts = args.prompt or list(PROMPTS)
    log_dir = wl.BENCH_DIR / "logs"
    answers: dict[str, list[dict[str, Any]]] = {}
    for name, flags in configs:
        serve_flags = ["--num-threads", str(args.threads), *shlex.split(flags)]
        with glmserve(serve_flags, log_dir / f"chat-{name}.log", args.ready_timeout) as url:
            answers[f"glmserve {name}"] = [ask(url, p, args.max_tokens) for p in prompts]
    give_up = time.monotonic() + args.wait_llamacpp  # llama-server may still be building (setup_peers.sh)
    while llama_server.missing() and time.monotonic() < give_up:
        time.sleep(10)
    why = llama_server.missing()
    if why:
        print(f"llama.cpp skipped: {why}", file=sys.stderr)
    else:
        time.sleep(5)  # the linker may still be writing it
        flags = ["-t", str(args.threads), "-tb", str(args.threads), "-np", "1", "-c", "4096", "--cache-ram", "0"]
        with llama_server.running(flags, log_dir / "chat-llama-server.log") as server:
            answers = {LLAMACPP: [ask(server.base_url, p, args.max_tokens) for p in prompts], **answers}
        version = llama_server.version()
    print("| prompt | engine | greedy answer | first token: top 3 (logprob) | prompt tokens |")
    print("|---|---|---|---|---|")
    for i, prompt in enumerate(prompts):
        for engine, rows in answers.items():
            row = rows[i]
            tops = ", ".join(f"`{t!r}` {lp}" for t, lp in row["first_token_top3"])
            text = row["answer"].replace("\n", " ").replace("|", "\\|")
            print(f"| {prompt} | {engine} | {text} | {tops} | {row['prompt_tokens']} |")
    if not why:
        print(f"\nllama.cpp: {version}; glmserve configs: " + "; ".join(f"{n}: `{f}`" for n, f in configs))
    if args.json:
        args.json.write_text(json.dumps({"prompts": prompts, "answers": answers}, indent=1))


if __name__ == "__main__":
    main()
