"""Engine speed on one CUDA GPU: glmserve vs transformers, side by side in one process, bf16.

Random weights of SmolLM2-135M's shape (the GGUF does not travel to GPU machines; speed does not
depend on the values). Prompts are random token ids of equal length, generation ignores EOS.

    python bench/bench_cuda.py [--out results.json]

Prints one JSON object: per metric ours, transformers and ours/transformers.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from glmserve import LLM, SamplingParams

SMOLLM2_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)


def make_model(out: Path, **overrides) -> Path:
    """Random bf16 weights plus a word-level tokenizer covering the whole vocabulary; `overrides` change
    config fields (e.g. max_position_embeddings)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**SMOLLM2_SHAPE, **overrides}), dtype=torch.bfloat16)
    model.save_pretrained(out)
    vocab = {f"w{i}": i for i in range(SMOLLM2_SHAPE["vocab_size"])}
    backend = Tokenizer(WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="w1", eos_token="w2").save_pretrained(out)
    return out


def prompts(n: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(n * 100003 + length)
    return torch.randint(3, SMOLLM2_SHAPE["vocab_size"], (n, length), generator=gen).tolist()


class Ours:
    name = "ours"

    def __init__(self, path: Path):
        self.llm = LLM(model=str(path), tokenizer=None, dtype="bfloat16", kv_cache_memory_bytes=4 << 30,
                       max_num_seqs=64, max_num_batched_tokens=8192, enable_prefix_caching=False)

    def generate(self, batch: list[list[int]], new_tokens: int) -> None:
        self.llm.generate(batch, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))


class Transformers:
    name = "transformers"

    def __init__(self, path: Path):
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()

    @torch.inference_mode()
    def generate(self, batch: list[list[int]], new_tokens: int) -> None:
        ids = torch.tensor(batch, device="cuda")
        self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)


def timed(engine, batch: list[list[int]], new_tokens: int, repeats: int = 2) -> float:
    """Best of `repeats` runs: the first run of a new shape also pays kernel selection and caching."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(batch, new_tokens)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def measure(engine) -> dict[str, float]:
    engine.generate(prompts(2, 64), 4)  # warm-up
    torch.cuda.reset_peak_memory_stats()
    out: dict[str, float] = {}
    for length in (2048, 8000):
        batch = prompts(1, length)
        out[f"prefill_{length}_tok_s"] = length / timed(engine, batch, 1)
    for batch_size in (1, 32):
        batch = prompts(batch_size, 128)
        first, full = timed(engine, batch, 1), timed(engine, batch, 129)
        out[f"decode_b{batch_size}_tok_s"] = batch_size * 128 / (full - first)
    batch = prompts(64, 512)
    out["throughput_64x512+256_tok_s"] = 64 * 256 / timed(engine, batch, 256)
    out["peak_gpu_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / "smollm2-shape")
        for cls in (Ours, Transformers):
            engine = cls(path)
            results[cls.name] = measure(engine)
            del engine
            torch.cuda.empty_cache()
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "metrics": {
            m: {"ours": results["ours"][m], "transformers": results["transformers"][m],
                "ratio": results["ours"][m] / results["transformers"][m]}
            for m in results["ours"]
        },
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
