"""Freezing a long-running process's startup heap out of the cycle collector (`freeze_startup_heap`).

Everything alive once a server has started (imported modules, the app, the loaded model's Python objects) lives
until the process ends, yet each full collection walks it: ~265K objects and 0.3 s in `glmserve serve` on the
embedded model, ~47K and 0.1 s in `glmserve gateway` (measured at load ~11 on the 2-core VM), a pause in the middle
of decode steps and proxied requests. `gc.freeze()` moves them to the permanent generation that collections skip.
The idea of vLLM's `freeze_gc_heap` (vllm/utils/gc_utils.py), which its server calls after init and warm-up.

Until then the collector need not run at all: a server start allocates that heap (torch's and fastapi's modules,
the tokenizer's vocabulary, the model's modules) and keeps nearly all of it, so the collections its allocations
trigger (full ones among them) walk objects that stay alive: 0.3-0.5 s of CPU of `glmserve serve`'s imports and load
(bench/RESULTS.md "Startup on the Xeon without AMX"). `pause_startup_collection` turns it off at the start;
`freeze_startup_heap` collects once and turns it back on.
"""

from __future__ import annotations

import gc


def pause_startup_collection() -> None:
    """No automatic collections until `freeze_startup_heap` (a server start's first step)."""
    gc.disable()


def freeze_startup_heap() -> int:
    """Collects today's garbage (so none of it is frozen for good), then freezes what is left and (re-)enables
    automatic collection; returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    gc.enable()
    return gc.get_freeze_count()
