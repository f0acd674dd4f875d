"""llama.cpp's own perplexity on a text file (the `llama-perplexity` tool), for bench_quality.py.

`llama-perplexity -f TEXT -c CTX -b CTX` (tools/perplexity/perplexity.cpp, `perplexity()`) tokenizes the whole
file, cuts it into non-overlapping CTX-token chunks, evaluates each on its own (-b CTX: one chunk per batch, as
our API scores one window per request) and scores each chunk's second half; it prints the chunk count and
"Final estimate: PPL = X". bench/quality_metrics.py cuts our windows the same way, so the scored-token counts
must match: `LlamaPerplexity.tokens` = chunks * (CTX - 1 - CTX/2), perplexity.cpp's per-chunk count.
`llama_tokens` asks a running `llama-server` for its token ids of a text, to check the two tokenizers agree.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx

_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")
_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


@dataclass(frozen=True)
class LlamaPerplexity:
    ppl: float
    stderr: float
    chunks: int
    ctx: int

    @property
    def tokens(self) -> int:
        """Scored tokens: perplexity.cpp scores positions ctx/2 .. ctx-2 of every chunk."""
        return self.chunks * (self.ctx - 1 - self.ctx // 2)


def llama_perplexity(binary: Path, gguf: str, text: Path, ctx: int, threads: int, log: Path) -> LlamaPerplexity:
    """Run llama-perplexity on `text`; its output goes to `log`. Raises RuntimeError with the log's end."""
    cmd = [str(binary), "-m", gguf, "-f", str(text), "-c", str(ctx), "-b", str(ctx), "-t", str(threads),
           "-tb", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    output = proc.stdout + proc.stderr
    log.write_text(" ".join(cmd) + "\n" + output)
    chunks, final = _CHUNKS.search(output), _FINAL.search(output)
    if proc.returncode != 0 or not chunks or not final:
        tail = "\n".join(output.strip().splitlines()[-8:])
        raise RuntimeError(f"llama-perplexity exited {proc.returncode} without a final estimate:\n{tail}")
    return LlamaPerplexity(float(final.group(1)), float(final.group(2)), int(chunks.group(1)), int(chunks.group(2)))


def llama_tokens(base_url: str, text: str) -> list[int]:
    """llama-server's token ids of `text`, with the special tokens its vocabulary adds (as llama-perplexity)."""
    response = httpx.post(f"{base_url}/tokenize", json={"content": text, "add_special": True}, timeout=120)
    response.raise_for_status()
    return [int(t) for t in response.json()["tokens"]]
