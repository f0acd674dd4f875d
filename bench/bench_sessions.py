"""Time to first token of a long session's next turn: cold compute vs the session's KV loaded back
from disk after a restart vs from Redis on another replica.

Per history length: engine A computes turn 1 (the history) with a session id; its KV is saved to a
session directory, then (the same turn again, a device prefix-cache hit) to Redis. A fresh engine
(a restart) on the directory and a fresh engine (another replica) on Redis then run turn 2 (the
history, the generated token and 32 new tokens): TTFT includes reading, checking and loading the
stored chunks. Cold: turn 2 on a fresh engine with a cache salt, so nothing is reused. Token ids are
random (timings do not depend on them). A redis-server is started on a free port unless --redis-url
is given.

    .venv/bin/python bench/bench_sessions.py --lengths 4096 8000 --threads 1
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from glmserve.config import EngineConfig
from glmserve.engine.llm_engine import LLMEngine
from glmserve.engine.sampling import SamplingParams
from glmserve.kv.session_io import open_session_kv


def start_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)], stdout=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def ttft(engine: LLMEngine, prompt: list[int], session_id: str | None = None, salt: str | None = None
         ) -> tuple[float, int, list[int]]:
    """Seconds to the first token, cached tokens, and the output of a one-token turn."""
    start = time.perf_counter()
    engine.add_request(f"r{time.monotonic_ns()}", prompt, SamplingParams(temperature=0, max_tokens=1,
                                                                         ignore_eos=True),
                       cache_salt=salt, session_id=session_id)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final is not None
    return time.perf_counter() - start, final.num_cached_tokens, final.outputs[0].token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8000])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--redis-url", default=None)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="glmserve-bench-sessions-"))
    redis_proc = None
    url = args.redis_url
    if url is None:
        redis_proc, url = start_redis(workdir)
    disk = str(workdir / "sessions")
    base = dict(dtype="float32", max_model_len=max(args.lengths) + 64, kv_cache_memory_bytes=1 << 30,
                num_threads=args.threads)
    rows = []
    try:
        for n in args.lengths:
            history = torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            sid = f"bench-{n}"
            first = LLMEngine(EngineConfig(session_store=disk, **base))
            t1, _, out = ttft(first, history, session_id=sid)
            start = time.perf_counter()
            first.kv.sessions.wait(sid)
            save_disk = time.perf_counter() - start
            first.close()
            c = first.config
            first.kv.sessions = open_session_kv(url, first.kv.blocks, first.kv.io, first.kv.identity,
                                                c.kv_chunk_tokens, c.session_max_bytes, c.session_ttl_s)
            ttft(first, history, session_id=sid)  # device hit; its end writes the session to Redis
            start = time.perf_counter()
            first.kv.sessions.wait(sid)
            save_redis = time.perf_counter() - start
            stored = first.kv.sessions.info(sid)
            first.close()
            del first
            turn2 = history + out + torch.randint(100, 40000, (32,)).tolist()
            restarted = LLMEngine(EngineConfig(session_store=disk, **base))
            cold, cold_cached, cold_out = ttft(restarted, turn2, salt="cold")
            from_disk, disk_cached, disk_out = ttft(restarted, turn2, session_id=sid)
            restarted.close()
            del restarted
            replica = LLMEngine(EngineConfig(session_store=url, **base))
            from_redis, redis_cached, redis_out = ttft(replica, turn2, session_id=sid)
            replica.close()
            del replica
            assert cold_cached == 0
            rows.append((n, len(turn2), stored["bytes"], t1, save_disk, save_redis, cold, from_disk, disk_cached,
                         from_redis, redis_cached, disk_out == cold_out == redis_out))
            print(rows[-1], flush=True)
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    print("\n| history tokens | turn-2 prompt | stored KV | turn 1 (s) | save disk / Redis (s) | TTFT cold (s) "
          "| TTFT disk after restart (s) | cached | TTFT Redis replica (s) | cached | cold / disk | cold / Redis "
          "| same token |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n, p, size, t1, sd, sr, cold, fd, dc, fr, rc, same in rows:
        print(f"| {n} | {p} | {size / 2**20:.0f} MiB | {t1:.1f} | {sd:.2f} / {sr:.2f} | {cold:.2f} | {fd:.2f} | {dc} "
              f"| {fr:.2f} | {rc} | {cold / fd:.1f}× | {cold / fr:.1f}× | {same} |")


if __name__ == "__main__":
    main()
