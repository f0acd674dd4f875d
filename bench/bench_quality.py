"""Quality of quantized formats through the API: perplexity and next-token KL divergence per configuration.

    .venv/bin/python bench/bench_quality.py --config float:"" --config bf16:"--dtype bfloat16" \
        --config w8a8:"--quantization w8a8" --config q4_1:"--quantization q4_1"

Each `--config NAME:FLAGS` is a real `glmserve serve` process started with FLAGS (any serve flags: model,
`--quantization`, `--kv-cache-dtype`, ...); the first configuration (or `--reference NAME`) is the reference,
normally our float32. The texts of bench/data (calibration and held-out split, English and Chinese) are cut into
llama-perplexity's windows (bench/quality_metrics.py) and every window is scored by `/v1/completions` with
`echo`, `logprobs: N`, `max_tokens: 0` (prompt logprobs, as lm-evaluation-harness scores text) and the token ids
returned as `token_id:ID`. Reported per configuration and split: perplexity per language and pooled, its change
against the reference, the estimated KL(reference || config) of the next-token distribution (top-N), the share
of positions with the same most likely token, and pass/fail against the issue's targets (by configuration name,
or `--target NAME=PCT`). With llama.cpp built (bench/setup_peers.sh llama-server), llama.cpp's own `llama-perplexity`
on the same GGUF and texts is a row too, from the logits it saves; it runs first, and every configuration is then
scored on its token ids (its tokenizer merges some whitespace runs that ours splits). Its KL/top-1 against the
reference and the KL/top-1 of each `--vs-llamacpp` configuration against llama.cpp are printed under the table,
and the perplexities of those configurations are compared with its (target: within 0.5%). Results: a markdown
table on stdout and a JSON report (`--json`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import llama_server  # noqa: E402
from peer_llamacpp_ppl import llama_perplexity  # noqa: E402
from quality_metrics import Scored, Summary, Window, summarize, windows  # noqa: E402
from serve_process import ServeFailed, glmserve  # noqa: E402

DATA = Path(__file__).parent / "data"
SPLITS = ("calib", "heldout")
LANGS = ("en", "zh")
BENCH_DIR = Path(os.environ.get("GLMSERVE_BENCH_DIR", Path.home() / ".cache" / "glmserve-bench"))
LLAMACPP = "llama.cpp"
# the perplexity targets against our float32, in percent, by configuration name
TARGETS = {"int8": 0.5, "q8_0": 0.5, "w8a8": 1.5, "fp8": 1.5, "fp8-block": 1.5, "w4a16": 8.0, "w4-rtn": 8.0,
           "w4a16-g32": 8.0, "w4-gptq": 4.0, "w4-awq": 4.0, "gptq": 4.0, "awq": 4.0, "mixed": 1.5, "recipe": 1.5}
LLAMACPP_TARGET = 0.5  # native GGUF perplexity within 0.5% of llama.cpp's on the same file


@dataclass
class Config:
    name: str
    flags: list[str]


def parse_config(text: str) -> Config:
    name, sep, flags = text.partition(":")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--config wants NAME:FLAGS (FLAGS may be empty), got {text!r}")
    return Config(name, shlex.split(flags))


def parse_target(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    try:
        return name, float(value) if sep else float("nan")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--target wants NAME=PERCENT, got {text!r}") from exc


def load_tokenizer(model: str | None):
    """The tokenizer of the served model (token ids are sent, so every configuration sees the same windows)."""
    if model is None or model.endswith(".gguf"):
        from glmserve.models.gguf_loader import embedded_default_gguf, load_gguf

        return load_gguf(Path(model) if model else embedded_default_gguf()).tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def corpus_windows(tokenizer, splits: list[str], ctx: int, max_windows: int | None) -> dict[str, list[Window]]:
    """`split/lang` -> its windows (the first `max_windows` of each text, when given)."""
    out = {}
    for split in splits:
        for lang in LANGS:
            cut = windows(f"{split}_{lang}", tokenizer.encode(_text(split, lang), add_special_tokens=True), ctx)
            out[f"{split}/{lang}"] = cut[:max_windows]
    return out


def score_through_api(base_url: str, work: dict[str, list[Window]], top: int) -> dict[str, list[Scored]]:
    """Every window scored by the server's prompt logprobs (one request per window)."""
    out: dict[str, list[Scored]] = {}
    with httpx.Client(base_url=base_url, timeout=1800) as http:
        for key, wins in work.items():
            out[key] = []
            for w in wins:
                body = {"prompt": w.tokens, "echo": True, "logprobs": top, "max_tokens": 0, "temperature": 0,
                        "return_tokens_as_token_ids": True}
                response = http.post("/v1/completions", json=body)
                response.raise_for_status()
                logprobs = response.json()["choices"][0]["logprobs"]
                ids = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
                if ids != w.tokens:
                    raise RuntimeError(f"the server echoed other tokens than it was sent ({key})")
                tops = [{int(t.removeprefix("token_id:")): v for t, v in d.items()}
                        for d in logprobs["top_logprobs"][w.first_scored:]]
                out[key].append(Scored(logprobs["token_logprobs"][w.first_scored:], tops))
    return out


def score_llamacpp(gguf: str, splits: list[str], work: dict[str, list[Window]], ctx: int, top: int, threads: int,
                   log_dir: Path) -> tuple[dict[str, list[Scored]], dict[str, list[Window]], list[str]]:
    """llama.cpp's own `llama-perplexity` on each text (bench/peer_llamacpp_ppl.py): per `split/lang` the
    Scored windows decoded from its saved logits, the windows it scored (its own token ids: llama.cpp's
    tokenizer merges some whitespace runs that ours, following the HF tokenizer, splits, e.g. "\n\n" before a
    digit, which shifts every later chunk), and the checks comparing those ids with ours and its printed
    perplexity. Every configuration is then scored on llama.cpp's windows, so that positions line up."""
    scored: dict[str, list[Scored]] = {}
    theirs: dict[str, list[Window]] = {}
    checks: list[str] = []
    for split in splits:
        for lang in LANGS:
            key = f"{split}/{lang}"
            result = llama_perplexity(llama_server.binary("llama-perplexity"), gguf, DATA / f"{split}_{lang}.txt",
                                      ctx, threads, top, log_dir / f"quality-llama-perplexity-{split}-{lang}.log")
            ours = [w.tokens for w in work[key]]
            same = sum(a == b for a, b in zip(result.chunks, ours))
            checks.append(f"{key}: llama-perplexity evaluated {len(result.chunks)} chunks of {ctx} tokens, our "
                          f"tokenizer cuts {len(ours)}, {same} with the same token ids; every row is scored on "
                          f"llama.cpp's; its printed PPL {result.ppl:.4f} ± {result.stderr:.4f}")
            scored[key] = result.scored
            theirs[key] = [Window(f"{split}_{lang}", chunk, len(chunk) // 2 + 1) for chunk in result.chunks]
    return scored, theirs, checks


def _text(split: str, lang: str) -> str:
    return (DATA / f"{split}_{lang}.txt").read_text(encoding="utf-8")


def llamacpp_available() -> str | None:
    """None when the llama.cpp peer can run, else why not."""
    if not llama_server.binary("llama-perplexity").exists():
        return f"{llama_server.binary('llama-perplexity')} missing: run bench/setup_peers.sh llama-server"
    return None


def split_summaries(scored: dict[str, list[Scored]], reference: dict[str, list[Scored]] | None,
                    splits: list[str]) -> dict[str, dict[str, Summary]]:
    """split -> {"en", "zh", "all"} -> Summary."""
    out: dict[str, dict[str, Summary]] = {}
    for split in splits:
        keys = [f"{split}/{lang}" for lang in LANGS]
        part = {lang: summarize(scored[k], reference[k] if reference else None) for lang, k in zip(LANGS, keys)}
        pooled = [s for k in keys for s in scored[k]]
        pooled_ref = [s for k in keys for s in reference[k]] if reference else None
        out[split] = {**part, "all": summarize(pooled, pooled_ref)}
    return out


def _pct(value: float, base: float) -> float:
    return 100.0 * (value / base - 1.0)


def _verdict(delta: float, target: float | None) -> str:
    if target is None or target != target:
        return "–"
    return f"{'pass' if delta <= target else 'FAIL'} (≤ +{target:g}%)"


def markdown(rows: dict[str, dict[str, dict[str, Summary]]], reference: str, targets: dict[str, float],
             vs_llamacpp: set[str], flags: dict[str, str], failed: dict[str, str]) -> str:
    head = ("| config | serve flags | split | ppl en | ppl zh | ppl all | Δ ppl vs " + reference +
            " | KL (nats) | same top-1 | target | vs llama.cpp |")
    lines = [head, "|" + "---|" * 11]
    for name, splits in rows.items():
        for split, s in splits.items():
            base = rows[reference][split]["all"].ppl
            delta = _pct(s["all"].ppl, base)
            kl = "–" if s["all"].kl is None else f"{s['all'].kl:.4f}"
            top1 = "–" if s["all"].top1 is None else f"{100 * s['all'].top1:.1f}%"
            versus = "–"
            if name in vs_llamacpp and LLAMACPP in rows:
                gap = _pct(s["all"].ppl, rows[LLAMACPP][split]["all"].ppl)
                versus = f"{gap:+.2f}% {'pass' if abs(gap) <= LLAMACPP_TARGET else 'FAIL'} (±{LLAMACPP_TARGET:g}%)"
            target = _verdict(delta, targets.get(name.lower())) if name not in (reference, LLAMACPP) else "–"
            lines.append(f"| {name} | `{flags.get(name, '')}` | {split} | {s['en'].ppl:.3f} | {s['zh'].ppl:.3f} | "
                         f"{s['all'].ppl:.3f} | {delta:+.2f}% | {kl} | {top1} | {target} | {versus} |")
    for name, why in failed.items():
        lines.append(f"| {name} | `{flags.get(name, '')}` | – | could not run: {why} |||||||")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=parse_config, action="append", required=True,
                        help='NAME:"SERVE FLAGS" (repeat; the first is the reference unless --reference)')
    parser.add_argument("--reference", help="the configuration the others are compared with (default: the first)")
    parser.add_argument("--model", help="model for the tokenizer and every server (default: embedded SmolLM2)")
    parser.add_argument("--ctx", type=int, default=512, help="window length in tokens (llama-perplexity's -c)")
    parser.add_argument("--top", type=int, default=20, help="top-N logprobs per position for the KL (at most 20)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--splits", default=",".join(SPLITS), help="texts of bench/data to score: calib,heldout")
    parser.add_argument("--max-windows", type=int, help="score only the first N windows of each text (a quick run)")
    parser.add_argument("--target", type=parse_target, action="append", default=[],
                        help="NAME=PERCENT: the allowed perplexity increase of configuration NAME")
    parser.add_argument("--vs-llamacpp", default="default,q4_1,q4_0,q8_0",
                        help="configurations (native GGUF) compared with llama.cpp's perplexity on the same file")
    parser.add_argument("--gguf", help="GGUF file for llama.cpp (default: --model if a .gguf, else the embedded)")
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--wait-llamacpp", type=float, default=0.0,
                        help="seconds to wait for llama-perplexity to be built, after scoring ours")
    parser.add_argument("--ready-timeout", type=float, default=900)
    parser.add_argument("--json", type=Path, default=None, help="default: bench/results/quality-DATE.json")
    args = parser.parse_args()
    names = [c.name for c in args.config]
    if len(set(names)) != len(names) or LLAMACPP in names:
        parser.error(f"configuration names must be unique and not {LLAMACPP!r}")
    reference = args.reference or names[0]
    if reference not in names:
        parser.error(f"--reference {reference!r} is not a configuration")
    targets = {**TARGETS, **{k.lower(): v for k, v in args.target}}
    started = time.time()
    tokenizer = load_tokenizer(args.model)
    splits = [x for x in args.splits.split(",") if x]
    if not splits or set(splits) - set(SPLITS):
        parser.error(f"--splits takes a comma-separated subset of {','.join(SPLITS)}")
    work = corpus_windows(tokenizer, splits, args.ctx, args.max_windows)
    log_dir = BENCH_DIR / "logs"
    scored: dict[str, dict[str, list[Scored]]] = {}
    checks: list[str] = []
    give_up = time.monotonic() + args.wait_llamacpp  # llama.cpp may still be building (setup_peers.sh)
    while not args.no_llamacpp and llamacpp_available() and time.monotonic() < give_up:
        time.sleep(10)
    llamacpp_note = "skipped (--no-llamacpp)" if args.no_llamacpp else llamacpp_available()
    if llamacpp_note is None and args.max_windows:
        llamacpp_note = "skipped: llama-perplexity scores whole texts, --max-windows cuts ours"
    if llamacpp_note is None:
        from glmserve.models.gguf_loader import embedded_default_gguf

        own = args.model if args.model and args.model.endswith(".gguf") else None
        gguf = args.gguf or own or str(embedded_default_gguf())
        scored[LLAMACPP], work, checks = score_llamacpp(gguf, splits, work, args.ctx, args.top, args.threads,
                                                        log_dir)
        llamacpp_note = f"llama-perplexity ({llama_server.version()}) on {Path(gguf).name}"
    else:
        print(f"[bench_quality] llama.cpp perplexity skipped: {llamacpp_note}", file=sys.stderr)
    base = ["--max-model-len", str(args.ctx), "--num-threads", str(args.threads)]
    if args.model:
        base += ["--model", args.model]
    failed: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for config in sorted(args.config, key=lambda c: c.name != reference):  # the reference first
        print(f"[bench_quality] {config.name}: glmserve serve {' '.join(base + config.flags)}", file=sys.stderr)
        t0 = time.monotonic()
        try:
            with glmserve(base + config.flags, log_dir / f"quality-{config.name}.log", args.ready_timeout) as url:
                scored[config.name] = score_through_api(url, work, args.top)
        except ServeFailed as exc:
            failed[config.name] = str(exc).splitlines()[-1][:160]
            print(f"[bench_quality] {config.name} could not run:\n{exc}", file=sys.stderr)
        seconds[config.name] = time.monotonic() - t0
    if reference not in scored:
        sys.exit(f"the reference configuration {reference!r} could not run: {failed[reference]}")
    rows = {name: split_summaries(s, None if name == reference else scored[reference], splits)
            for name, s in sorted(scored.items(), key=lambda item: item[0] == LLAMACPP)}
    if LLAMACPP in scored:
        for name in sorted(set(args.vs_llamacpp.split(",")) & set(scored) - {LLAMACPP}):
            for split, parts in split_summaries(scored[name], scored[LLAMACPP], splits).items():
                checks.append(f"{name} against llama.cpp ({split}): KL(llama.cpp || {name}) {parts['all'].kl:.4f} "
                              f"nats, same top-1 token at {100 * parts['all'].top1:.1f}% of positions")
    flags = {c.name: " ".join(c.flags) for c in args.config}
    table = markdown(rows, reference, targets, set(args.vs_llamacpp.split(",")), flags, failed)
    print(table)
    print(f"\nllama.cpp: {llamacpp_note}")
    print("\n".join(f"- {c}" for c in checks))
    report = {
        "date": datetime.date.today().isoformat(), "command": " ".join(shlex.quote(a) for a in sys.argv),
        "ctx": args.ctx, "top": args.top, "threads": args.threads, "reference": reference,
        "windows": {k: len(v) for k, v in work.items()}, "llamacpp": llamacpp_note, "llamacpp_checks": checks,
        "failed": failed,
        "seconds": seconds, "wall_s": time.time() - started,
        "results": {name: {split: {part: asdict(s) for part, s in parts.items()} for split, parts in by_split.items()}
                    for name, by_split in rows.items()},
        "table": table,
    }
    out = args.json or Path(__file__).parent / "results" / f"quality-{report['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"report: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
