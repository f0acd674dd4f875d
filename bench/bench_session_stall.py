"""How long a running request stalls while another request's session KV is restored.

A session of `--history` tokens is computed once into a session directory (`--store`, kept between
runs, so the same stored session serves runs of different code). Each run: a fresh engine (a
restart: nothing on the device) decodes a short "other" request; after a few of its tokens, the
session's next turn (history + 1 token + 32 new tokens) is added. Reported: how long `add_request`
itself took, the longest gap between two tokens of the other request from then until its end (its
stall), its median gap before, and the session turn's time to first token and cached tokens. The
session's chunk files are dropped from the page cache (posix_fadvise DONTNEED) before each run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_session_stall.py --history 4096 --store /tmp/stall
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from glmserve.config import EngineConfig
from glmserve.engine.llm_engine import LLMEngine
from glmserve.engine.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from bench_tiers import drop_page_cache  # noqa: E402

OTHER_TOKENS = 48  # the other request's length: it must still run when the session's restore ends


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def build_session(config: EngineConfig, history: list[int], session_id: str) -> list[int]:
    """Turn 1 of the session (computed, saved); returns its generated token."""
    engine = LLMEngine(config)
    engine.add_request("turn1", history, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                       session_id=session_id)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    engine.close()
    assert out is not None
    return out.outputs[0].token_ids


def measure(config: EngineConfig, turn2: list[int], session_id: str) -> dict:
    engine = LLMEngine(config)
    greedy = SamplingParams(temperature=0, max_tokens=OTHER_TOKENS, ignore_eos=True)
    engine.add_request("other", tokens(7, 32), greedy)
    stamps: list[float] = []  # when each token of the other request arrived
    session_added = session_first = None
    add_seconds = 0.0
    steps: list[tuple[float, float, bool]] = []  # after the session turn is added: (step s, of it restore s, prefill)
    stats = getattr(engine.kv.sessions, "stats", None)  # the engine-thread part of a restore (newer code only)
    while engine.has_unfinished_requests():
        step_start, load_before = time.perf_counter(), stats.restore_load_seconds if stats else 0.0
        outs = engine.step()
        if session_added is not None and session_first is None:
            load = (stats.restore_load_seconds if stats else 0.0) - load_before
            prefill = any(o.request_id == "turn2" for o in outs)
            steps.append((round(time.perf_counter() - step_start, 3), round(load, 3), prefill))
        for out in outs:
            now = time.perf_counter()
            if out.request_id == "other" and len(out.outputs[0].token_ids) > len(stamps):
                stamps.append(now)
            elif out.request_id == "turn2" and out.outputs[0].token_ids and session_first is None:
                session_first, cached = now, out.num_cached_tokens
        if session_added is None and len(stamps) == 8:
            session_added = time.perf_counter()
            engine.add_request("turn2", turn2, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                               session_id=session_id)
            add_seconds = time.perf_counter() - session_added
    load_seconds = stats.restore_load_seconds if stats is not None else None
    engine.close()
    assert session_added is not None and session_first is not None
    before = [b - a for a, b in zip(stamps[:8], stamps[1:8])]
    during = [b - a for a, b in zip(stamps[7:], stamps[8:])]
    return {"add_request_s": add_seconds, "other_median_gap_s": statistics.median(before),
            "other_max_gap_after_add_s": max(during), "steps_until_session_token": steps,
            "restore_in_engine_step_s": load_seconds, "session_ttft_s": session_first - session_added,
            "cached": cached, "other_finished_after_session": stamps[-1] > session_first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history", type=int, default=4096)
    parser.add_argument("--store", required=True, help="session directory (built on the first run)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    store = Path(args.store)
    config = EngineConfig(dtype="float32", max_model_len=args.history + 64, kv_cache_memory_bytes=1 << 30,
                          num_threads=args.threads, session_store=str(store), kv_chunk_tokens=2048)
    history = tokens(args.history, args.history)
    session_id = f"stall-{args.history}"
    reply_file = store / f"reply-{args.history}.txt"
    if not reply_file.exists():
        store.mkdir(parents=True, exist_ok=True)
        reply_file.write_text(" ".join(map(str, build_session(config, history, session_id))))
    turn2 = history + [int(t) for t in reply_file.read_text().split()] + tokens(1, 32)
    for _ in range(args.runs):
        drop_page_cache(store)
        print(measure(config, turn2, session_id), flush=True)


if __name__ == "__main__":
    main()
