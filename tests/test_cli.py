"""The CLI as a user runs it: a real subprocess, output on stdout, clear errors with exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "glmserve.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_generate_prints_one_completion_per_prompt(tiny_model_dir):
    """stdout is exactly the engine's greedy completion of each prompt, one line each, in order."""
    import torch

    from glmserve import LLM, SamplingParams

    model, prompts = str(tiny_model_dir("llama")), ["The quick", "Paged attention"]
    out = _run("generate", "--model", model, "--max-tokens", "4", "--kv-cache-memory-bytes", "4000000",
               "--device", "cpu", "--dtype", "float32", *prompts)
    assert out.returncode == 0, out.stderr
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the CLI runs (OMP_NUM_THREADS=1)
    try:
        llm = LLM(model=model, kv_cache_memory_bytes=4000000, device="cpu", dtype="float32")
        expected = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0))
    finally:
        torch.set_num_threads(threads)
    assert out.stdout == "".join(o.outputs[0].text + "\n" for o in expected)


def test_chat_without_template_and_missing_model_are_clear_errors(tiny_model_dir, tmp_path):
    out = _run("chat", "--model", str(tiny_model_dir("llama")), "-m", "hi", "--kv-cache-memory-bytes", "4000000")
    assert out.returncode == 2 and "no chat template" in out.stderr and "Traceback" not in out.stderr
    out = _run("generate", "--model", str(tmp_path / "nope"), "x")
    assert out.returncode == 2 and "never downloads weights" in out.stderr and "Traceback" not in out.stderr
