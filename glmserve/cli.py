"""Command line: `glmserve generate | chat | serve | billing | train-indexer | quantize | compress | data`. With
no --model, the embedded SmolLM2 runs."""

from __future__ import annotations

import argparse
import importlib
import sys

from glmserve.config import KV_CACHE_DTYPES, EngineConfig
from glmserve.errors import GlmServeError
from glmserve.server.config import add_server_args, server_config_from_args
from glmserve.sparse_settings import MODES, SEEDS_THRESHOLD


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2-135M)")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache format: auto (int8 for a float32 model on CPU, bfloat16 where its attention reads "
                        "no int8 rows; else the model dtype), a float dtype, or int8 / fp8 (E4M3) codes with a "
                        "scale per token and kv head (about half of bfloat16's bytes)")
    g.add_argument("--device", default="auto")
    g.add_argument("--quantization", default=None, metavar="SCHEME",
                   help="weights: unset = the checkpoint's own format (GGUF blocks run natively), 'none' = float, "
                   "or quantize on load: int8[-g64|-g32], w8a8, w4a16[-asym][-g64], fp8[-a16|-g32|-g16], "
                   "fp8-block[-g128], nvfp4, q8_0, q4_0, q4_1")
    g.add_argument("--quantize-embeddings", action="store_true",
                   help="with --quantization SCHEME: quantize embeddings and lm_head too")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument("--kv-chunk-tokens", type=int, default=2048, help="tokens per KV chunk moved between tiers")
    g.add_argument("--kv-host-memory-bytes", type=int, default=None,
                   help="host-RAM KV tier (default: 25%% of free RAM on CUDA, off on CPU)")
    g.add_argument("--kv-disk-dir", default=None, help="disk KV tier directory (default: off)")
    g.add_argument("--kv-disk-bytes", type=int, default=16 << 30, help="disk KV tier budget")
    s = parser.add_argument_group("sparse decode attention (defaults per mode: glmserve/sparse_settings.py)")
    s.add_argument("--sparse-attention", default=None, choices=list(MODES),
                   help="default mode (default: native for models with their own indexer, else dense)")
    s.add_argument("--sparse-top-k", type=int, default=None, help="token budget per decode query")
    s.add_argument("--sparse-threshold", "--dsa-threshold", dest="sparse_threshold", type=float, default=None,
                   help=f"threshold mode on min-max normalized scores, in (0, 1] (seeds: {SEEDS_THRESHOLD}; "
                        "--dsa-threshold is the seeds' name)")
    s.add_argument("--sparse-sink-tokens", type=int, default=None, help="first tokens always attended")
    s.add_argument("--sparse-local-tokens", type=int, default=None, help="most recent tokens always attended")
    s.add_argument("--no-sparse-block-bounds", dest="sparse_block_bounds", action="store_false",
                   help="do not keep the block indexer's key bounds (saves 1/block_size of KV memory; no block mode)")
    s.add_argument("--learned-indexer", default=None, metavar="PATH|none",
                   help="learned indexer file for mode 'learned' (default: the one beside the model, if trained)")
    k = parser.add_argument_group("sessions (requests with a session_id keep their KV between turns)")
    k.add_argument("--session-store", default=None, metavar="DIR|redis://...|off",
                   help="where session KV is kept (default: sessions/ in $GLMSERVE_CACHE_DIR, ~/.cache/glmserve "
                        "if unset; a redis:// URL for replicas)")
    k.add_argument("--session-ttl", dest="session_ttl_s", type=float, default=86400.0,
                   help="seconds an unused session is kept")
    k.add_argument("--session-max-bytes", type=int, default=8 << 30,
                   help="size cap of the session store; the least recently used sessions are dropped first")


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    values = {name: getattr(args, name) for name in EngineConfig.field_names() if hasattr(args, name)}
    values.update(overrides)
    return EngineConfig(**values)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)


def sampling_from_args(args: argparse.Namespace):
    from glmserve.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def _stream(engine, prompt, params, out=sys.stdout) -> str:
    """Runs one request to the end, printing text as it arrives; returns the full text."""
    engine.add_request("cli", prompt, params)
    shown = 0
    text = ""
    while engine.has_unfinished_requests():
        for result in engine.step():
            text = result.outputs[0].text
            out.write(text[shown:])
            out.flush()
            shown = len(text)
    out.write("\n")
    return text


def cmd_generate(args: argparse.Namespace) -> None:
    from glmserve.engine.llm import LLM

    llm = LLM(**vars(engine_config_from_args(args)))
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    for out in llm.generate(prompts, sampling_from_args(args)):
        print(out.outputs[0].text)


def cmd_chat(args: argparse.Namespace) -> None:
    from glmserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config_from_args(args))
    params = sampling_from_args(args)
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = args.message is None and sys.stdin.isatty()
    lines = [args.message] if args.message is not None else None
    if interactive:
        print(f"glmserve chat with {engine.model_name} (empty line or Ctrl-D quits)")
    source = lines if lines is not None else _read_lines(interactive)
    for user_text in source:
        if not user_text.strip():
            break
        messages.append({"role": "user", "content": user_text})
        reply = _stream(engine, engine.apply_chat_template(messages), params)
        messages.append({"role": "assistant", "content": reply})


def _read_lines(interactive: bool):
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except EOFError:
            return
        if not interactive and line == "":
            return
        yield line.rstrip("\n")


def cmd_serve(args: argparse.Namespace) -> None:
    from glmserve.gc_heap import pause_startup_collection

    pause_startup_collection()  # until the engine is ready (glmserve/gc_heap.py); before torch's import
    from glmserve.server.launch import run_server

    sys.exit(run_server(engine_config_from_args(args), server_config_from_args(args)))


def cmd_billing_report(args: argparse.Namespace) -> None:
    from glmserve.gateway.billing import report

    print(report(args.ledger, args.since, args.key, as_json=args.json))


def cmd_gateway(args: argparse.Namespace) -> None:
    from glmserve.gateway.app import run_gateway
    from glmserve.gateway.proxy_options import ProxyOptions
    from glmserve.gateway.settings import GatewaySettings

    sys.exit(run_gateway(GatewaySettings.from_args(args), ProxyOptions.from_args(args), args.host, args.port,
                         args.workers))


def cmd_train_indexer(args: argparse.Namespace) -> None:
    from glmserve.training.indexer_distill import DistillConfig, train_and_save

    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    cfg = DistillConfig(**{name: getattr(args, name) for name in TRAIN_INDEXER_OPTIONS if hasattr(args, name)})
    path, report = train_and_save(None if args.model == "default" else args.model, args.text, args.out, cfg,
                                  log=lambda line: print(line, file=sys.stderr, flush=True),
                                  quantization=args.quantization)
    print(f"train KL {report.train_kl_before:.3f} -> {report.train_kl:.3f}, held-out KL "
          f"{report.heldout_kl_before:.3f} -> {report.heldout_kl:.3f} ({report.train_seconds:.0f} s training, "
          f"{report.teacher_seconds:.0f} s teacher)")
    print(f"attention mass in {cfg.budget} tokens (layer mean): "
          + ", ".join(f"{name} {value:.3f}" for name, value in report.recall.items()))
    print(f"saved {path}")


QUANTIZE_DTYPES = {"auto": None, "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def add_quantize_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="'default' (the embedded SmolLM2 GGUF), a .gguf file or an HF model folder")
    parser.add_argument("--scheme", default=None, help="one scheme for every linear layer but lm_head "
                        "(int8, int8-g64, int8-g32, w8a8, w4a16, w4a16-asym, w4a16-g64, fp8, fp8-a16, fp8-block, "
                        "fp8-block-g128, fp8-g32, fp8-g16, nvfp4)")
    parser.add_argument("--recipe", default=None, metavar="FILE", help="YAML/JSON recipe: module patterns -> "
                        "schemes, or the seeds' form (examples/quant/seeds_mixed.yaml)")
    parser.add_argument("--bits-budget", type=float, default=None, metavar="B",
                        help="choose per-layer schemes by measured sensitivity under B bits per weight; with "
                        "--recipe, upgrade the recipe's layers (their schemes the floor) under B")
    parser.add_argument("--candidates", default=None, help="schemes a --bits-budget chooses from (comma-"
                        "separated, 'none' for float; default int8,w4a16,w4a16-g64, with --recipe the recipe's own)")
    parser.add_argument("--calib", nargs="+", default=None, metavar="FILE", help="calibration text file(s)")
    parser.add_argument("--calib-tokens", type=int, default=4096, help="calibration tokens used at most, an "
                        "equal share from each file")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    parser.add_argument("--method", default="rtn", choices=["rtn", "gptq", "awq", "awq-gptq"],
                        help="round to nearest, GPTQ, AWQ, or AWQ's scales then GPTQ (needs --calib)")
    parser.add_argument("--gptq-damp", type=float, default=0.01, metavar="F", help="GPTQ's damping: F times the "
                        "mean Hessian diagonal added to it (default 0.01)")
    parser.add_argument("--scale-search", action="store_true", help="set each (row, group)'s scale (and zero "
                        "point) by a search for the smallest rounding error weighted by the calibration inputs' "
                        "mean square (plain squared error without --calib) instead of from the absmax; integer "
                        "and FP8 weights, with rtn, gptq (scales then kept fixed) or awq-gptq")
    parser.add_argument("--sequential", action="store_true", help="calibrate each decoder layer on the outputs of "
                        "the layers below it as already quantized (GPTQ's sequential order, sublayer by sublayer), "
                        "not on the float model's in one pass; needs --calib")
    parser.add_argument("--asymmetric", action="store_true", help="with --sequential and GPTQ: fit each layer to "
                        "the float model's output on the float inputs (GPTAQ), not to its own weights on the "
                        "quantized inputs")
    parser.add_argument("--asymmetric-damp", type=float, default=None, metavar="F", help="with --asymmetric: the "
                        "float target's ridge towards the layer's own weights, F times the mean Hessian diagonal "
                        "(default: --gptq-damp); larger trusts the calibration tokens less")
    parser.add_argument("--smooth", type=float, default=None, metavar="ALPHA", help="SmoothQuant: migrate "
                        "activation outliers into the weights with strength ALPHA in [0, 1] (0.5 typical; for "
                        "w8a8 / fp8; needs --calib)")
    parser.add_argument("--sensitivity", default=None, choices=["measured", "fisher"],
                        help="--bits-budget: measure each layer unit's loss increase, or estimate it from the "
                        "Fisher diagonal (one gradient pass over the calibration text); default: the recipe's "
                        "`sensitivity`, else measured")
    parser.add_argument("--rotate", nargs="?", const="auto", default=None, choices=["auto", "hadamard", "random"],
                        help="first rotate the residual stream (QuaRot's R1: norms folded, lm_head untied; the "
                        "float model's function is unchanged, its outlier channels spread): a randomized Hadamard "
                        "where the size allows (auto, the default kind), or a random orthogonal matrix")
    parser.add_argument("--tune-steps", type=int, default=0, metavar="N", help="after quantizing, train each "
                        "group's scale (and float minimum), a recipe's float outlier columns and every norm's weight "
                        "for N steps so the quantized "
                        "model's next-token distributions match the float model's on the calibration text (codes "
                        "unchanged; needs --calib; about 7 s a step for SmolLM2-135M on 2 cores)")
    parser.add_argument("--tune-lr", type=float, default=1e-3, help="Adam's learning rate of --tune-steps, "
                        "relative to each scale (default 1e-3)")
    parser.add_argument("--tune-samples", type=int, default=0, metavar="N", help="with --tune-steps: also tune "
                        "on N windows the float model writes, each continuing a piece of the calibration text "
                        "(sampling, fixed seed; about 4 s a window for SmolLM2-135M on 2 cores), so each window is "
                        "seen fewer times")
    parser.add_argument("--tune-dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the quantized "
                        "model's compute dtype while tuning: bfloat16 (autocast, faster) or float32 (for formats "
                        "whose error is below bfloat16's, e.g. w8a8)")
    parser.add_argument("--dtype", default="auto", choices=list(QUANTIZE_DTYPES),
                        help="dtype of the tensors kept in float (auto: each as the source stores it; bfloat16 "
                             "for a GGUF's block-quantized ones)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--num-threads", type=int, default=None)


def run_quantize(model, out: str, *, scheme: str | None = None, recipe: str | None = None,
                 bits_budget: float | None = None, candidates: str | None = None, calib: list[str] | None = None,
                 calib_tokens: int = 4096, seq_len: int = 512, method: str = "rtn", dtype: str = "auto",
                 sensitivity: str | None = None, smooth: float | None = None, stats=None, gptq_damp: float = 0.01,
                 rotate: str | None = None, scale_search: bool = False, sequential: bool = False,
                 asymmetric: bool = False, asymmetric_damp: float | None = None, tune_steps: int = 0,
                 tune_lr: float = 1e-3, tune_dtype: str = "bfloat16", tune_samples: int = 0):
    """Quantize `model` (a path, 'default', or a loaded models.hf_float.FloatCheckpoint, left unchanged) into a
    compressed-tensors folder `out`; returns (float model, pipeline Result). `stats`: calibration statistics
    already collected on these windows (calibrate.collect_stats), reused instead of collected again. `rotate`
    (or the recipe's `rotate`): rotate the residual stream first (quant/rotate.py); the returned float model is
    the rotated one. `tune_steps` > 0: then train the scales, float minimums, outlier columns and norms end to end
    against the float model for that many steps (quant/tune.py), on `tune_samples` windows the float model writes
    as well."""
    import copy
    from pathlib import Path

    import torch

    from glmserve.errors import InvalidRequestError
    from glmserve.models.hf_float import FloatCheckpoint, load_float
    from glmserve.quant import pipeline
    from glmserve.quant.perplexity import token_windows
    from glmserve.quant.recipe import load_recipe, uniform
    from glmserve.quant.rotate import rotate_model
    from glmserve.quant.tune import TuneOptions

    if (scheme is not None) + (recipe is not None) + (bits_budget is not None and recipe is None) != 1:
        raise InvalidRequestError("give exactly one of --scheme, --recipe, --bits-budget (or --recipe with "
                                  "--bits-budget: the recipe's schemes upgraded by sensitivity under the budget)")
    if scheme is not None:
        pipeline.scheme_specs(scheme)
    if not 0 < gptq_damp <= 1:
        raise InvalidRequestError(f"--gptq-damp must be in (0, 1], not {gptq_damp}")
    if tune_steps < 0 or tune_lr <= 0 or tune_samples < 0:
        raise InvalidRequestError(f"--tune-steps and --tune-samples must be >= 0 and --tune-lr > 0, not "
                                  f"{tune_steps}, {tune_samples} and {tune_lr}")
    if tune_samples and not tune_steps:
        raise InvalidRequestError("--tune-samples are windows to tune on: give --tune-steps as well")
    plan = pipeline.Plan(recipe=load_recipe(recipe) if recipe else uniform(scheme) if scheme else None,
                         bits_budget=bits_budget, method=method, sensitivity=sensitivity, smooth=smooth,
                         gptq_damp=gptq_damp, scale_search=scale_search, sequential=sequential,
                         asymmetric=asymmetric, asymmetric_damp=asymmetric_damp,
                         tune=TuneOptions(steps=tune_steps, lr=tune_lr, dtype=getattr(torch, tune_dtype),
                                          samples=tune_samples)
                         if tune_steps else None)
    if candidates:
        plan.candidates = tuple(c.strip() for c in candidates.split(","))
    if pipeline.needs_calibration(plan) and not calib:
        raise InvalidRequestError("this needs calibration text: give --calib FILE (GPTQ, AWQ, --smooth, "
                                  "--bits-budget, --tune-steps and a recipe's activation_threshold measure "
                                  "activations)")
    rotate = rotate or (plan.recipe.rotate if plan.recipe else None)
    if rotate and stats is not None:
        raise InvalidRequestError("calibration statistics of the unrotated model do not describe the rotated one")
    ckpt = model if isinstance(model, FloatCheckpoint) else load_float(model)
    if rotate:
        if ckpt is model:  # the caller's model stays as it was
            ckpt = FloatCheckpoint(copy.deepcopy(ckpt.model), ckpt.tokenizer, ckpt.source, ckpt.float_dtypes)
        rotate_model(ckpt.model, rotate)
    windows = None
    if calib:
        windows = [w for f in calib  # each file gets an equal share of the tokens (e.g. English and Chinese)
                   for w in token_windows(ckpt.tokenizer, Path(f).read_text(encoding="utf-8"), seq_len,
                                          max(calib_tokens // len(calib), 2))]
    result = pipeline.quantize_model(ckpt.model, plan, windows, stats)
    torch_dtype = ckpt.float_dtypes if QUANTIZE_DTYPES[dtype] is None else getattr(torch, QUANTIZE_DTYPES[dtype])
    pipeline.save(Path(out), ckpt.model, ckpt.tokenizer, result, torch_dtype)
    return ckpt.model, result


def cmd_quantize(args: argparse.Namespace) -> None:
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    from glmserve.quant.pipeline import weight_bytes

    model, result = run_quantize(args.model, args.out, scheme=args.scheme, recipe=args.recipe,
                                 bits_budget=args.bits_budget, candidates=args.candidates, calib=args.calib,
                                 calib_tokens=args.calib_tokens, seq_len=args.seq_len, method=args.method,
                                 dtype=args.dtype, sensitivity=args.sensitivity, smooth=args.smooth,
                                 gptq_damp=args.gptq_damp, rotate=args.rotate, scale_search=args.scale_search,
                                 sequential=args.sequential, asymmetric=args.asymmetric,
                                 asymmetric_damp=args.asymmetric_damp, tune_steps=args.tune_steps,
                                 tune_lr=args.tune_lr, tune_dtype=args.tune_dtype, tune_samples=args.tune_samples)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    counts: dict[str, int] = {}
    for s in result.schemes.values():
        counts[s] = counts.get(s, 0) + 1
    served, bf16 = weight_bytes(model, result)
    print("layers: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    print(f"weights {served / 2**20:.1f} MiB served vs {bf16 / 2**20:.1f} MiB in bf16 ({1 - served / bf16:.1%} "
          f"smaller); wrote {args.out}")


# DistillConfig fields settable from the command line (unset ones keep DistillConfig's defaults)
TRAIN_INDEXER_OPTIONS = {
    "steps": (int, "optimizer steps"), "window": (int, "tokens per teacher window"),
    "dim": (int, "index key / index query head size"), "heads": (int, "index query heads"),
    "lr": (float, "Adam learning rate"), "max_windows": (int, "windows of text used"),
    "heldout_windows": (int, "last windows kept out of training (held-out KL and recall)"),
    "budget": (int, "token budget of the reported attention-mass recall"),
}


def add_train_indexer_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="HF model directory, .gguf file, or 'default' "
                        "(the embedded SmolLM2)")
    parser.add_argument("--text", nargs="+", required=True, metavar="FILE", help="training text file(s)")
    parser.add_argument("--out", default=None, help="output file (default: where the engine finds it: beside "
                        "the model, or indexers/ in $GLMSERVE_CACHE_DIR (~/.cache/glmserve if unset) for the embedded "
                        "model or a read-only directory)")
    for name, (kind, text) in TRAIN_INDEXER_OPTIONS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=argparse.SUPPRESS,
                            help=f"{text} (default: glmserve/training/indexer_distill.py DistillConfig)")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--quantization", default=None, metavar="SCHEME",
                        help="the teacher's weights, as the engine's --quantization (unset: the checkpoint's format)")


def add_gateway_cli_args(parser: argparse.ArgumentParser) -> None:
    from glmserve.gateway.proxy_options import add_proxy_options
    from glmserve.gateway.settings import add_gateway_options

    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="gateway processes on one socket (more than one core; with --keys, needs --redis)")
    add_proxy_options(parser)
    add_gateway_options(parser)


def cmd_compress(args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    from glmserve.compress import Document, compress
    from glmserve.compress.tokens import HFTokenCounter

    docs = []
    for name in args.files:
        try:
            docs.append(Document(name, Path(name).read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError) as exc:
            raise GlmServeError(f"cannot read {name}: {exc}") from exc
    counter = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        counter = HFTokenCounter(AutoTokenizer.from_pretrained(args.tokenizer))
    result = compress(docs, query=args.query, ratio=args.ratio, target_tokens=args.target_tokens,
                      preset=args.preset, count_tokens=counter)
    if args.json:
        print(json.dumps(result.to_dict(), ensure_ascii=False, indent=1))
    else:
        print(result.text)
        print(f"\n[{result.original_tokens} -> {result.compressed_tokens} tokens, {result.ratio:.2f}x, "
              f"{len(result.spans)} spans]", file=sys.stderr)


# subcommands whose parsers live in their packages ("module:function" adding them): importing those packages costs
# ~0.5 s of CPU (glmserve.compress, numpy), so a command line naming another subcommand does not build them
PACKAGE_COMMANDS = {
    "data": "glmserve.data.cli:add_data_parser",
    "draft": "glmserve.compress.drafting.cli:add_draft_parser",
    "rag": "glmserve.compress.rag.cli:add_rag_parser",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand's parser; with `command` (the subcommand a command line names) the PACKAGE_COMMANDS other
    than it are left out (an unknown `command` keeps them all, so that argparse lists every choice)."""
    parser = argparse.ArgumentParser(prog="glmserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts (arguments, or one per stdin line)")
    gen.add_argument("prompt", nargs="*")
    gen.set_defaults(handler=cmd_generate)
    chat = sub.add_parser("chat", help="chat with the model (interactive, stdin lines, or --message)")
    chat.add_argument("-m", "--message", default=None, help="one message, print the reply, exit")
    chat.add_argument("--system", default=None)
    chat.set_defaults(handler=cmd_chat)
    for p in (gen, chat):
        add_engine_args(p)
        add_sampling_args(p)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (port 8000)")
    add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(handler=cmd_serve)
    billing = sub.add_parser("billing", help="the gateway's billing ledger")
    billing_sub = billing.add_subparsers(dest="billing_command", required=True)
    billing_report = billing_sub.add_parser("report", help="cost per key and model, with and without the cached-input "
                                            "discount, and the saving")
    billing_report.add_argument("--ledger", default=None, metavar="sqlite:///PATH|postgresql://...",
                                help="the ledger (default: the SQLite file under the glmserve cache directory)")
    billing_report.add_argument("--since", default=None, metavar="YYYY-MM-DD", help="rows from this UTC date on")
    billing_report.add_argument("--key", default=None, metavar="NAME", help="one key only")
    billing_report.add_argument("--json", action="store_true", help="JSON instead of a table")
    billing_report.set_defaults(handler=cmd_billing_report)
    gateway = sub.add_parser("gateway", help="OpenAI-compatible gateway in front of replicas (port 8080)")
    add_gateway_cli_args(gateway)
    gateway.set_defaults(handler=cmd_gateway)
    train = sub.add_parser("train-indexer", help="distill a learned sparse-attention indexer from the model's "
                           "dense attention (CPU, float32)")
    add_train_indexer_args(train)
    train.set_defaults(handler=cmd_train_indexer)
    quant = sub.add_parser("quantize", help="write a quantized compressed-tensors safetensors folder")
    add_quantize_args(quant)
    quant.set_defaults(handler=cmd_quantize)
    comp = sub.add_parser("compress", help="semantic context compression with a trace map (anchors kept verbatim)")
    comp.add_argument("files", nargs="+", metavar="FILE")
    comp.add_argument("--query", default=None, help="compress for this question (relevance + diversity)")
    budget = comp.add_mutually_exclusive_group()
    budget.add_argument("--ratio", type=float, default=None, help="target compression ratio (default 3.4)")
    budget.add_argument("--target-tokens", type=int, default=None, help="token budget of the output")
    budget.add_argument("--preset", choices=["short", "medium", "long"], default=None,
                        help="token budget by task: short 4K, medium 32K, long 128K")
    comp.add_argument("--tokenizer", default=None, help="count tokens with this HF tokenizer (default: the "
                      "embedded SmolLM2's)")
    comp.add_argument("--json", action="store_true", help="the text, token counts and trace map as JSON")
    comp.set_defaults(handler=cmd_compress)
    for name, adder in PACKAGE_COMMANDS.items():
        if command in (None, name) or command not in {*sub.choices, *PACKAGE_COMMANDS}:
            module, _, function = adder.partition(":")
            getattr(importlib.import_module(module), function)(sub)
    return parser


def _command(argv: list[str] | None) -> str | None:
    """The subcommand the command line names (its first word, unless that is an option such as --help)."""
    words = sys.argv[1:] if argv is None else argv
    return words[0] if words and not words[0].startswith("-") else None


def main(argv: list[str] | None = None) -> None:
    args = build_parser(_command(argv)).parse_args(argv)
    try:
        args.handler(args)
    except GlmServeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
