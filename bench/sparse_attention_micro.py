"""One attention layer's decode at a long context: dense vs block-sparse (Quest-style selection + attention).

SmolLM2-135M's attention shape (9 heads, 3 kv heads, head_dim 64, block 16). Random K/V are written into
a paged pool through the block indexer's own write hook, so the bounds are maintained as in the engine;
then `PagedAttention`'s decode runs dense (every key) and in block mode (sinks 16, local window 256,
the given token budget), and the selection alone is timed too. No model weights are needed.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sparse_attention_micro.py --contexts 8192,32768,131072 --batch 1,8
"""

from __future__ import annotations

import argparse
import time

import torch

from glmserve.layers.attention import GroupMetadata, PagedAttention
from glmserve.sparse.block import BlockIndexer
from glmserve.sparse.selection import SparseRows
from glmserve.sparse_settings import SparseAttentionParams

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def build(ctx: int, batch: int, device: torch.device) -> tuple[PagedAttention, GroupMetadata, torch.Tensor]:
    """A layer whose pool holds `batch` sequences of `ctx` random keys/values, their decode group, and queries."""
    blocks_per_seq = -(-ctx // BLOCK)
    num_blocks = 1 + batch * blocks_per_seq
    attn = PagedAttention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    attn.kv_cache = torch.zeros(2, KV_HEADS, num_blocks * BLOCK, HEAD_DIM, device=device)
    attn.indexers["block"] = BlockIndexer(KV_HEADS, HEAD_DIM, num_blocks, BLOCK, attn.scale, torch.float32, device)
    tables = (1 + torch.arange(batch * blocks_per_seq, device=device)).view(batch, blocks_per_seq)
    pos = torch.arange(ctx, device=device)
    kv_slots = tables[:, pos // BLOCK] * BLOCK + pos % BLOCK
    gen = torch.Generator().manual_seed(0)
    for start in range(0, ctx, 4096):  # in chunks, as chunked prefill writes them
        slots = kv_slots[:, start:start + 4096].reshape(-1)
        k = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=gen).to(device)
        v = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=gen).to(device)
        attn.kv_cache[0].index_copy_(1, slots, k.transpose(0, 1))
        attn.kv_cache[1].index_copy_(1, slots, v.transpose(0, 1))
        attn.indexers["block"].on_kv_written(slots, k, attn.kv_cache)
    lens = torch.full((batch,), ctx, device=device)
    group = GroupMetadata(kv_slots=kv_slots, key_mask=(pos[None] < lens[:, None])[:, None], num_tokens=batch,
                          context_lens=lens, block_tables=tables)
    return attn, group, torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(device)


def timed_ms(fn, args: tuple, device: torch.device, repeats: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn(*args)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    sync()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="8192,32768,131072")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--top-k", type=int, default=2048)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    params = SparseAttentionParams("block", top_k=args.top_k, sink_tokens=16, local_tokens=256)
    print(f"{'context':>8} {'batch':>5} {'dense ms':>9} {'block ms':>9} {'select ms':>9} {'speedup':>7}")
    for ctx in map(int, args.contexts.split(",")):
        for batch in map(int, args.batch.split(",")):
            attn, group, q = build(ctx, batch, device)
            dense = timed_ms(attn._decode, (q, group), device, args.repeats)  # decode only: no K/V write
            group.sparse = SparseRows.from_params([params] * batch, device)
            sparse = timed_ms(attn._decode, (q, group), device, args.repeats)
            select = timed_ms(attn.select, (q, group), device, args.repeats)
            print(f"{ctx:>8} {batch:>5} {dense:>9.2f} {sparse:>9.2f} {select:>9.2f} {dense / sparse:>6.2f}x")


if __name__ == "__main__":
    main()
