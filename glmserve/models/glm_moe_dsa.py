"""GLM-5.x (`GlmMoeDsaForCausalLM`) and DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) on the paged KV cache:
MLA attention, the DSA lightning indexer with sparse attention, and MoE.

Reference: transformers' models/glm_moe_dsa/modeling_glm_moe_dsa.py (GlmMoeDsaAttention, GlmMoeDsaIndexer,
GlmMoeDsaTopkRouter, GlmMoeDsaMoE) and models/deepseek_v32/modeling_deepseek_v32.py, which is the same model
except that its indexer rotates the rope slice in two halves (not in interleaved pairs) and that every layer
runs its own indexer (no `indexer_types`).

Cache (our own layout, one pool allocated by `bind_kv_cache`):
- per layer, one latent row per token: `kv_a_layernorm(c_kv) | rope(k_rope)` (kv_lora_rank + qk_rope_head_dim);
- per layer that runs an indexer, its key per token (index_head_dim), at the same slot as the latent row,
  so prefix-cache hits share the indexer keys too.

Attention is computed in the "absorbed" form: a query's nope part is mapped into the latent space by the
key half of `kv_b_proj`, scored against the cached latent rows, and the weighted latent sum is mapped to
values by the value half of `kv_b_proj`. It equals the reference's expand-then-attend form exactly in math.

Per query, the indexer scores every past token with `sum_h w_h * relu(q_h . k)` and keeps the top
`index_topk`; attention then gathers only those latent rows from the paged cache. When no context in the
group is longer than `index_topk`, every query sees all of its keys (the reference does the same: its
top-k then covers the whole causal context), and attention is dense over the gathered context.

Per-request sparse settings (glmserve/sparse_settings.py) reach the decode group: rows in "native" mode
without overrides keep the exact top-`index_topk` rule above; a row with its own `top_k` or `threshold`
(or in "dense" mode) is selected by the generic rule of glmserve/sparse/selection.py on the indexer's
token scores (unit size 1). Prefill always runs the model's own indexer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from glmserve.errors import UnsupportedKVFormatError
from glmserve.kv.kv_format import KVFormat, kv_format
from glmserve.layers.attention import PagedAttention
from glmserve.layers.embedding import unset_embedding
from glmserve.layers.linear import MergedLinear
from glmserve.layers.norm import RMSNorm
from glmserve.layers.paged_metadata import StepRows, key_slots, padded_queries
from glmserve.layers.param_loading import Shard, copy_into
from glmserve.layers.rotary import RopeTables, inverse_frequencies, rope_parameters
from glmserve.models.llama import GatedMLP
from glmserve.models.weights import CheckpointLayout, LoadsCheckpoint
from glmserve.sparse.selection import SparseRows, compact, keep_mask

if TYPE_CHECKING:  # a type only: importing transformers costs ~2.5 s at server start
    from transformers import PretrainedConfig

TILE_ELEMENTS = 1 << 24  # bound on the elements of one score/gather tile (queries are processed in tiles)
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default eps, not config.rms_norm_eps
INDEXER_NORM_EPS = 1e-6  # the indexer's k_norm LayerNorm


def _tiles(n: int, cost_per_item: int, budget: int = TILE_ELEMENTS) -> list[slice]:
    step = max(1, budget // max(1, cost_per_item))
    return [slice(i, min(n, i + step)) for i in range(0, n, step)]


# -- rotary -------------------------------------------------------------------------------------------------------

def attention_scale(config: PretrainedConfig) -> float:
    """qk_head_dim ** -0.5, times mscale**2 under yarn with `mscale_all_dim` (reference: yarn_apply_mscale)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if params["rope_type"] != "default" and mscale_all_dim and params.get("factor", 1.0) > 1:
        mscale = 0.1 * mscale_all_dim * math.log(params["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


class MlaRotary(RopeTables):
    """cos/sin of each rotary pair's angle, [max_positions, qk_rope_head_dim / 2] (times the rope type's
    attention scaling, as the reference multiplies its cos/sin)."""

    def __init__(self, config: PretrainedConfig, max_positions: int):
        with torch.device("cpu"):  # real tables even when the model is built on the meta device
            # the reference config points `head_dim` at the rope slice
            inv_freq, scaling, _ = inverse_frequencies(config, config.qk_rope_head_dim)
            angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
            self.cos_table = angles.cos() * scaling
            self.sin_table = angles.sin() * scaling



def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3), ... each rotated by one angle. As the reference's
    apply_rotary_pos_emb_interleave, the result lists the rotated first members, then the rotated second
    members: a fixed permutation applied alike to queries and keys, so dot products are unchanged."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style halves (x[:d/2], x[d/2:]) rotated together (reference: DeepSeek-V3.2's indexer rope)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# -- per-step views of the attention groups -------------------------------------------------------------------------

@dataclass
class GroupView:
    """One attention group (decode or prefill) as padded queries [B, Q] against key positions [B, L]."""

    tokens: slice  # the group's rows in the flat batch
    kv_slots: torch.Tensor  # [B, L] cache slot of key position j of row b
    query_index: torch.Tensor  # [B, Q] group-local token of each padded query (padding repeats a real one)
    valid_index: torch.Tensor  # [Tg] place of each real query in the padded [B * Q] grid
    query_pos: torch.Tensor  # [B, Q] position of each padded query (its keys are positions 0..pos)
    token_pos: torch.Tensor  # [Tg] position of each token of the group
    token_row: torch.Tensor  # [Tg] row of kv_slots each token reads
    context_lens: torch.Tensor | None = None  # [B] decode group: keys per row
    sparse: SparseRows | None = None  # decode group: per-row sparse settings (None: the model's own rule)


@dataclass
class MlaMetadata:
    """A step's attention metadata for MLA: where each new token's latent row goes, and the groups."""

    slot_mapping: torch.Tensor  # [T]
    groups: list[GroupView]  # decode first, then prefill (those present)


def mla_metadata(step: StepRows) -> MlaMetadata:
    """The step's decode and prefill groups as MLA reads them: every row's whole context (this model's KV
    does not offload), decode rows with their sparse settings (the model's own indexer: always)."""
    n, b = step.num_decode, len(step.lens)
    groups = ([_mla_group(step, slice(0, n), decode=True)] if n else []) + (
        [_mla_group(step, slice(n, b), decode=False)] if n < b else [])
    return MlaMetadata(step.slot_mapping, groups)


def _mla_group(step: StepRows, rows: slice, decode: bool) -> GroupView:
    """Decode is Q = 1; a fresh causal prefill (one sequence from position 0) reads its own new slots."""
    dev = step.device
    starts, lens, first = step.starts[rows], step.lens[rows], step.first_tokens[rows]
    tokens = slice(int(first[0]), int(first[0] + lens.sum()))
    pos = step.positions[tokens]
    local = torch.arange(tokens.stop - tokens.start, device=dev)
    if not decode and len(lens) == 1 and int(starts[0]) == 0:  # key position j is its j-th new token
        kv_slots, query_index, valid_index = step.slot_mapping[tokens].unsqueeze(0), local.unsqueeze(0), local
    else:
        kv_slots = key_slots(step.tables[rows], starts + lens, step.block_size)[2].to(dev)
        if decode:
            query_index, valid_index = local.unsqueeze(1), local
        else:
            query_index, valid_index = (t.to(dev) for t in padded_queries(lens, first - first[0]))
    context_lens = (starts + lens).to(dev) if decode else None
    sparse = SparseRows.from_params(step.sparse[rows], dev, step.decode_pins) if decode else None
    return GroupView(tokens, kv_slots, query_index, valid_index, pos[query_index], pos,
                     valid_index // query_index.shape[1], context_lens, sparse)


@dataclass
class Selection:
    """Key positions each token of a group attends to; `positions` None means all of its causal context."""

    positions: torch.Tensor | None = None  # [Tg, k]
    valid: torch.Tensor | None = None  # [Tg, k] False where a pick lies beyond the query (short contexts)


# -- DSA lightning indexer --------------------------------------------------------------------------------------

class LightningIndexer(nn.Module):
    """Scores past tokens per query and keeps the top `index_topk` (reference: GlmMoeDsaIndexer.forward).

    q = wq_b(q_resid) per head, k = LayerNorm(wk(x)) one vector per token; rope on the first
    qk_rope_head_dim dims of both; score[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j] / sqrt(d)) with
    w = weights_proj(x) / sqrt(heads), computed in float32 as the reference does.
    """

    def __init__(self, config: PretrainedConfig, rope: Callable):
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.topk = config.index_topk
        self.rope = rope
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEXER_NORM_EPS)
        # the reference keeps weights_proj in float32 (_keep_in_fp32_modules)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False, dtype=torch.float32)
        self.softmax_scale = self.head_dim**-0.5
        self.cache: torch.Tensor | None = None  # [slots, index_head_dim]

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rope_dim], x[..., self.rope_dim:]
        return torch.cat([self.rope(rot, cos, sin), rest], dim=-1)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, cos_sin, slot_mapping: torch.Tensor,
                groups: list[GroupView]) -> list[Selection]:
        t = x.shape[0]
        q = self._rotate(self.wq_b(q_resid).view(t, self.n_heads, self.head_dim), *cos_sin)
        k = self._rotate(self.k_norm(self.wk(x)).unsqueeze(1), *cos_sin).squeeze(1)
        self.cache.index_copy_(0, slot_mapping, k.to(self.cache.dtype))
        weights = self.weights_proj(x.float()) * self.n_heads**-0.5  # [T, H]
        return [self._select(q[g.tokens].float(), weights[g.tokens], g) for g in groups]

    def scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q [B, R, H, D], weights [B, R, H], keys [B, L, D] (float32) -> index scores [B, R, L]."""
        b, r, h, d = q.shape
        dots = torch.matmul(q.reshape(b, r * h, d), keys.transpose(1, 2)).view(b, r, h, -1)
        dots = F.relu(dots * self.softmax_scale)
        return torch.matmul(weights.unsqueeze(-2), dots).squeeze(-2)

    def _select(self, q: torch.Tensor, weights: torch.Tensor, g: GroupView) -> Selection:
        if g.sparse is not None and not g.sparse.model_default_only:
            return self._select_rows(q, weights, g)
        b, qlen = g.query_index.shape
        length = g.kv_slots.shape[1]
        if length <= self.topk:  # no context longer than top-k: every query keeps all of its keys
            return Selection()
        keys = self.cache.index_select(0, g.kv_slots.reshape(-1)).view(b, length, self.head_dim).float()
        key_pos = torch.arange(length, device=q.device)
        top = torch.empty((b, qlen, self.topk), dtype=torch.long, device=q.device)
        for rows in _tiles(qlen, b * self.n_heads * length):
            qi = g.query_index[:, rows]
            s = self.scores(q[qi], weights[qi], keys)
            s.masked_fill_(key_pos > g.query_pos[:, rows, None], float("-inf"))
            top[:, rows] = s.topk(self.topk, dim=-1).indices
        top = top.view(b * qlen, self.topk)[g.valid_index]
        return Selection(positions=top, valid=top <= g.token_pos[:, None])

    def _select_rows(self, q: torch.Tensor, weights: torch.Tensor, g: GroupView) -> Selection:
        """Decode group with per-row settings: the indexer's token scores through the generic selection;
        "native" rows without a budget or threshold keep the model's `index_topk`."""
        b, length = g.kv_slots.shape
        keys = self.cache.index_select(0, g.kv_slots.reshape(-1)).view(b, length, self.head_dim).float()
        qi = g.query_index  # [B, 1]
        scores = self.scores(q[qi], weights[qi], keys)[:, 0]  # [B, L]
        rows = g.sparse
        plain = rows.rows_in("native") & (rows.top_k < 0) & (rows.threshold < 0)
        rows = dataclasses.replace(rows, top_k=torch.where(plain, self.topk, rows.top_k))
        keep = keep_mask(scores, 1, g.context_lens, rows, length)
        keep |= rows.rows_in("dense")[:, None] & (torch.arange(length, device=q.device) < g.context_lens[:, None])
        positions, _, lengths = compact(keep, g.kv_slots)
        valid = torch.arange(positions.shape[1], device=q.device)[None, :] < lengths[:, None]
        return Selection(positions=positions, valid=valid)


# -- MLA attention ----------------------------------------------------------------------------------------------

class MlaAttention(nn.Module):
    """Multi-head latent attention on the paged latent cache, sparse where the indexer selects."""

    def __init__(self, config: PretrainedConfig, runs_indexer: bool, indexer_rope: Callable):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.latent_dim = config.kv_lora_rank
        bias = bool(getattr(config, "attention_bias", False))
        # q_a_proj | kv_a_proj_with_mqa: one matmul on the same input
        self.qkv_a_proj = MergedLinear(config.hidden_size, [config.q_lora_rank, self.latent_dim + self.rope_dim],
                                       bias=bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * (self.nope_dim + self.rope_dim), bias=False)
        self.kv_a_layernorm = RMSNorm(self.latent_dim, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.latent_dim, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, config.hidden_size, bias=bias)
        self.scale = attention_scale(config)
        self.indexer = LightningIndexer(config, indexer_rope) if runs_indexer else None
        self.cache: torch.Tensor | None = None  # [slots, kv_lora_rank + qk_rope_head_dim]

    def forward(self, x: torch.Tensor, cos_sin, slot_mapping: torch.Tensor, groups: list[GroupView],
                shared: list[Selection] | None) -> tuple[torch.Tensor, list[Selection]]:
        t, h = x.shape[0], self.num_heads
        q_a, kv_a = self.qkv_a_proj.split(self.qkv_a_proj(x))
        q_resid = self.q_a_layernorm(q_a)
        q_nope, q_rope = self.q_b_proj(q_resid).view(t, h, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_rope = kv_a.split([self.latent_dim, self.rope_dim], dim=-1)
        q_rope = rope_interleaved(q_rope, *cos_sin)
        k_rope = rope_interleaved(k_rope.unsqueeze(1), *cos_sin).squeeze(1)
        self.cache.index_copy_(0, slot_mapping, torch.cat([self.kv_a_layernorm(c_kv), k_rope], -1).to(self.cache.dtype))

        kv_b = self.kv_b_proj.weight.view(h, self.nope_dim + self.v_dim, self.latent_dim)
        q_latent = torch.einsum("thn,hnc->thc", q_nope, kv_b[:, : self.nope_dim])
        query = torch.cat([q_latent, q_rope], dim=-1)  # scored against the latent row [c_kv | k_rope]

        if self.indexer is not None:
            selections = self.indexer(x, q_resid, cos_sin, slot_mapping, groups)
        elif shared is None:
            raise ValueError("a shared-indexer layer needs a previous layer that runs the indexer")
        else:
            selections = shared  # IndexShare: reuse the previous full layer's top-k
        outs = [self._attend(query[g.tokens], g, s) for g, s in zip(groups, selections)]
        out_latent = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)  # [T, H, latent]
        out = torch.einsum("thc,hvc->thv", out_latent, kv_b[:, self.nope_dim:])
        return self.o_proj(out.reshape(t, h * self.v_dim)), selections

    def _attend(self, q: torch.Tensor, g: GroupView, sel: Selection) -> torch.Tensor:
        """q [Tg, H, latent + rope] -> weighted latent rows [Tg, H, latent]."""
        if sel.positions is None:
            return self._dense(q, g)
        return self._sparse(q, g, sel)

    def _softmax_latent(self, scores: torch.Tensor, masked: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        scores.masked_fill_(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(rows.dtype)
        return torch.matmul(probs, rows[..., : self.latent_dim])

    def _dense(self, q: torch.Tensor, g: GroupView) -> torch.Tensor:
        """Every query against its whole causal context, gathered once per row."""
        b, qlen = g.query_index.shape
        length, h, width = g.kv_slots.shape[1], self.num_heads, q.shape[-1]
        rows = self.cache.index_select(0, g.kv_slots.reshape(-1)).view(b, length, width).to(q.dtype)
        key_pos = torch.arange(length, device=q.device)
        out = q.new_empty((b, qlen, h, self.latent_dim))
        for part in _tiles(qlen, b * h * length):
            r = part.stop - part.start
            qs = q[g.query_index[:, part]].reshape(b, r * h, width)
            scores = torch.matmul(qs, rows.transpose(1, 2)).mul_(self.scale).view(b, r, h, length)
            masked = (key_pos > g.query_pos[:, part, None]).unsqueeze(2)  # [b, r, 1, L]
            out[:, part] = self._softmax_latent(scores, masked, rows.unsqueeze(1))
        return out.view(b * qlen, h, self.latent_dim)[g.valid_index]

    def _sparse(self, q: torch.Tensor, g: GroupView, sel: Selection) -> torch.Tensor:
        """Each query against its selected positions only, gathered from the paged latent cache."""
        n, k = sel.positions.shape
        width = q.shape[-1]
        slots = g.kv_slots.reshape(-1)[g.token_row[:, None] * g.kv_slots.shape[1] + sel.positions]  # [Tg, k]
        out = q.new_empty((n, self.num_heads, self.latent_dim))
        for part in _tiles(n, k * (width + self.num_heads)):
            rows = self.cache.index_select(0, slots[part].reshape(-1)).view(-1, k, width).to(q.dtype)
            scores = torch.matmul(q[part], rows.transpose(1, 2)).mul_(self.scale)  # [r, H, k]
            out[part] = self._softmax_latent(scores, ~sel.valid[part, None, :], rows)
        return out


# -- MoE --------------------------------------------------------------------------------------------------------

class TopkRouter(nn.Module):
    """Sigmoid scores; choice by score + e_score_correction_bias within the best `topk_group` of `n_group`
    groups (a group's score: the sum of its two best); weights are the plain scores of the chosen, normalized
    if norm_topk_prob, times routed_scaling_factor (reference: GlmMoeDsaTopkRouter). float32, as the
    reference keeps gate.weight and the bias in float32."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.empty(self.num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, top_k] float32, expert ids [T, top_k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class RoutedExperts(nn.Module):
    """Expert weights as 3D tensors, the reference's layout: gate|up [E, 2I, hidden], down [E, hidden, I]."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        e, hidden, inter = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.intermediate_size = inter
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(e, hidden, inter))

    def load_parameter(self, param: nn.Parameter, tensor: torch.Tensor, shard: Shard) -> None:
        """One expert's matrix (Shard.part 0: gate, 1: up of gate_up_proj), or the whole 3D tensor."""
        dst = param.data if shard.expert is None else param.data[shard.expert]
        if shard.part is not None:
            dst = dst[shard.part * self.intermediate_size:(shard.part + 1) * self.intermediate_size]
        copy_into(dst, tensor)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Tokens sorted by expert; one batched matmul pair per expert that got any token."""
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // top_k
        routed_x, routed_w = x[token], weights.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            part = slice(start, start + count)
            gate, up = F.linear(routed_x[part], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert]) * routed_w[part, None]
            out.index_add_(0, token[part], y.to(out.dtype))
            start += count
        return out


class MoE(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.gate = TopkRouter(config)
        self.experts = RoutedExperts(config)
        self.shared_experts = GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids) + self.shared_experts(x)


# -- decoder ----------------------------------------------------------------------------------------------------

class DsaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, index: int, runs_indexer: bool, indexer_rope: Callable):
        super().__init__()
        self.self_attn = MlaAttention(config, runs_indexer, indexer_rope)
        dense = _mlp_layer_types(config)[index] == "dense"
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size) if dense else MoE(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos_sin, slot_mapping: torch.Tensor, groups: list[GroupView],
                shared: list[Selection] | None) -> tuple[torch.Tensor, list[Selection]]:
        h, selections = self.self_attn(self.input_layernorm(x), cos_sin, slot_mapping, groups, shared)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), selections


def _mlp_layer_types(config: PretrainedConfig) -> list[str]:
    types = getattr(config, "mlp_layer_types", None)
    if types is None:
        n_dense = min(config.first_k_dense_replace, config.num_hidden_layers)
        types = ["dense"] * n_dense + ["sparse"] * (config.num_hidden_layers - n_dense)
    return list(types)


def _float_kv(dtype: torch.dtype | str | KVFormat) -> torch.dtype:
    """The latent cache's dtype for KV format `dtype`; quantized formats are refused: the latent row holds the
    compressed KV and the rope key side by side, and the absorbed attention reads it as one matrix (its
    scales per token would have to enter both the score and the value products)."""
    fmt = kv_format(dtype)
    if fmt.quantized:
        raise UnsupportedKVFormatError(f"KV cache format {fmt.name!r} is not supported by the MLA latent cache "
                                       "(GLM-5.x / DeepSeek-V3.2); use auto, float32, bfloat16 or float16")
    return fmt.storage


class GlmMoeDsaForCausalLM(LoadsCheckpoint, nn.Module):
    """Embedding, MLA + DSA decoder layers (dense MLP for the first `first_k_dense_replace`, MoE after),
    final norm, LM head. Every layer writes its latent rows; layers whose `indexer_types` entry is "full"
    also write indexer keys and select, "shared" layers reuse the previous full layer's selection.

    Checkpoints ship experts per expert (`experts.{e}.gate_proj.weight`) or, as transformers holds them
    in memory, as 3D tensors (`experts.gate_up_proj`); both load. Layers past num_hidden_layers (the MTP
    layer) are skipped."""

    checkpoint_layout = CheckpointLayout(
        fused={
            "q_a_proj.{kind}": ("qkv_a_proj.{kind}", 0),
            "kv_a_proj_with_mqa.{kind}": ("qkv_a_proj.{kind}", 1),
            "experts.{expert}.gate_proj.weight": ("experts.gate_up_proj", 0),
            "experts.{expert}.up_proj.weight": ("experts.gate_up_proj", 1),
            "experts.{expert}.down_proj.weight": ("experts.down_proj", None),
            "gate_proj.{kind}": ("gate_up_proj.{kind}", 0),
            "up_proj.{kind}": ("gate_up_proj.{kind}", 1),
        },
        skip_layers_beyond_config=True,
    )
    indexer_rope = staticmethod(rope_interleaved)
    # kept float by --quantization (glmserve/models/quantized.py): MLA reads kv_b_proj's weight directly, the
    # indexer keeps float32 weights as the reference does; routed experts are 3D tensors, no Linear modules
    unquantized_modules = ("kv_b_proj", "indexer")
    native_sparse_attention = True  # the engine offers the "native" sparse mode

    def __init__(self, config: PretrainedConfig, max_positions: int):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}")
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.indexer_types = list(getattr(config, "indexer_types", None) or ["full"] * self.num_layers)
        if self.indexer_types[0] != "full":
            raise ValueError("the first layer must run the indexer (indexer_types[0] == 'full')")
        self.rotary = MlaRotary(config, max_positions)
        self.embed_tokens = unset_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([
            DsaDecoderLayer(config, i, self.indexer_types[i] == "full", self.indexer_rope)
            for i in range(self.num_layers)
        ])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)  # tied by load_weights
        # optional hook (tests, analysis): called as f(layer index, token positions [T], Selection) per group
        # for every layer that runs the indexer
        self.selection_observer: Callable[[int, torch.Tensor, Selection], None] | None = None

    def paged_attention_layers(self) -> list[PagedAttention]:
        """None: MLA attention reads its own latent cache, where no block or learned scorer attaches."""
        return []

    def sparse_modes(self) -> tuple[str, ...]:
        """Dense, and the model's own lightning indexer ("native")."""
        return ("dense", "native")

    # -- KV cache ---------------------------------------------------------------------------------------------
    def _cache_widths(self) -> tuple[int, int]:
        c = self.config
        num_indexers = sum(t == "full" for t in self.indexer_types)
        return self.num_layers * (c.kv_lora_rank + c.qk_rope_head_dim), num_indexers * c.index_head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype | str | KVFormat) -> int:
        return sum(self._cache_widths()) * torch.empty((), dtype=_float_kv(dtype)).element_size()

    def bind_kv_cache(self, num_slots: int, dtype: torch.dtype | str | KVFormat, device: torch.device,
                      zero_slots: int = 0) -> torch.Tensor:
        """One pool: latent rows [layers, slots, kv_lora_rank + rope], then indexer keys [indexers, slots,
        index_head_dim]. torch.empty: pages are only touched once written; the first `zero_slots` slots
        (the null block that padding points at) are zeroed. Float KV formats only."""
        dtype = _float_kv(dtype)
        latent_width, index_width = self._cache_widths()
        pool = torch.empty(num_slots * (latent_width + index_width), dtype=dtype, device=device)
        latent = pool[: num_slots * latent_width].view(self.num_layers, num_slots, -1)
        keys = pool[num_slots * latent_width:].view(-1, num_slots, self.config.index_head_dim)
        latent[:, :zero_slots].zero_()
        keys[:, :zero_slots].zero_()
        indexers = 0
        for i, layer in enumerate(self.layers):
            layer.self_attn.cache = latent[i]
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.cache = keys[indexers]
                indexers += 1
        return pool

    def kv_slot_views(self, pool: torch.Tensor) -> list[torch.Tensor]:
        """The pool of `bind_kv_cache` as [groups, slots, width] views (latent rows, indexer keys), for KV I/O."""
        latent_width, _ = self._cache_widths()
        num_slots = pool.numel() // sum(self._cache_widths())
        return [pool[: num_slots * latent_width].view(self.num_layers, num_slots, -1),
                pool[num_slots * latent_width:].view(-1, num_slots, self.config.index_head_dim)]

    # -- forward ----------------------------------------------------------------------------------------------
    def attention_metadata(self, step: StepRows) -> MlaMetadata:
        """The step's groups for MLA (`mla_metadata`)."""
        return mla_metadata(step)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: MlaMetadata,
                logits_index: torch.Tensor) -> torch.Tensor:
        """Flat batch in, logits of the rows in `logits_index` out ([S, vocab], float32)."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions)
        groups = meta.groups
        selections = None
        for i, layer in enumerate(self.layers):
            x, selections = layer(x, cos_sin, meta.slot_mapping, groups, selections)
            if self.selection_observer is not None and layer.self_attn.indexer is not None:
                for g, sel in zip(groups, selections):
                    self.selection_observer(i, g.token_pos, sel)
        x = self.norm(x[logits_index])
        return self.lm_head(x).float()


class DeepseekV32ForCausalLM(GlmMoeDsaForCausalLM):
    """DeepSeek-V3.2: the same model, but the indexer's rope rotates halves, and every layer runs its own
    indexer (reference: transformers' DeepseekV32Indexer, apply_rotary_pos_emb)."""

    indexer_rope = staticmethod(rope_half_split)
