"""Learned token-level indexer for models trained without one: a small per-layer scorer distilled from the
model's own dense attention (training: glmserve/training/indexer_distill.py, CLI `glmserve train-indexer`).

Form: the lightning indexer of DeepSeek-V3.2 / GLM-5 DSA (DeepSeek-AI 2025, "DeepSeek-V3.2-Exp: Boosting
Long-Context Efficiency with DeepSeek Sparse Attention", eq. 1; our native version is
glmserve/models/glm_moe_dsa.py), read off the layer's own post-rope queries and keys instead of new
projections of the hidden state, so it needs no change to the model:

    index key   k'_j = W_k · k_j                  k_j: the token's keys of all kv heads, flattened
    index query q'_h = W_q,h · q, w = W_w · q     q: the query token's queries of all heads, flattened
    score       s_j  = sum_h w_h * relu(q'_h · k'_j) / sqrt(d) + b_dist[bucket(i - j)] + b_sink[j]

The last two terms are ours: a learned bias per distance bucket (exact up to 8, then half octaves, as the
log buckets of T5's relative attention bias) and per sink position (j < 4), a cheap floor for positional
patterns (rope's decay with distance, attention sinks) that a low-rank projection of post-rope keys
expresses poorly. W_w starts at zero (flat first scores); measurements in docs/LEARNED_INDEXER.md.

Index keys (d values per token and layer, in bfloat16 whatever the model's dtype, as DeepSeek-V3.2 keeps
its indexer in FP8: 1/24 of SmolLM2's KV in float32, 1/12 in bfloat16; each decode step reads every index
key of the context, so their size sets the scorer's speed) live in their own paged pool at the same
slots as the KV (`IndexKeyPool`), so prefix-cache hits share them; KV that the tiers or the session store
load into the pool gets its index keys recomputed from the loaded K (`IndexKeyPool.refresh`). The engine
allocates the pool only when an indexer file is loaded. The weights of all layers are stacked
([layers, in, out]) so that training scores every layer in one batched matmul.

File format: safetensors with `wq`, `wk`, `ww`, `distance_bias`, `sink_bias` and string metadata:
format/version, the model's identity (architecture, layers, heads, kv heads, head dim, a fingerprint of
its q/k/v weights) and the index dims. The default place is beside the model (`default_indexer_path`);
loading checks the identity against the model and raises `IndexerMismatchError` with what differs.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from glmserve import kernels
from glmserve.errors import IndexerMismatchError
from glmserve.kv.kv_format import dequantize
from glmserve.paths import cache_dir
from glmserve.sparse.indexer import ScoredLayer, ScoringRows, attach_indexers
from glmserve.sparse.selection import positions_upto

FORMAT_NAME = "glmserve-learned-indexer"
FORMAT_VERSION = 1
FILE_SUFFIX = "glmserve-indexer.safetensors"
FINGERPRINT_SAMPLES = 4096  # strided q/k/v weight elements hashed per layer
DISTANCE_BUCKETS = 32  # distance buckets of the position bias: 0..7 exact, then half octaves (last: >= 23,170)
SINK_BIAS_TOKENS = 4  # first positions with a bias of their own (attention sinks)
INDEX_KEY_DTYPE = torch.bfloat16  # the index-key pool's dtype (see above)


def distance_bucket(distance: torch.Tensor) -> torch.Tensor:
    """Bucket of a query-key distance (>= 0): exact below 8, then two buckets per octave, the last one open."""
    d = distance.clamp(min=0)
    log_bucket = 8 + (2 * torch.log2(d.clamp(min=8).float() / 8)).long()
    return torch.where(d < 8, d, log_bucket).clamp(max=DISTANCE_BUCKETS - 1)


@dataclass(frozen=True)
class ModelIdentity:
    """What an indexer file must match: the attention shapes and the weights that produce q and k."""

    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    fingerprint: str

    @classmethod
    def of(cls, model: nn.Module) -> ModelIdentity:
        attn = [layer.self_attn for layer in model.layers]
        archs = getattr(model.config, "architectures", None) or [type(model).__name__]
        return cls(archs[0], len(attn), attn[0].num_heads, attn[0].num_kv_heads, attn[0].head_dim,
                   weights_fingerprint(model))


def weights_fingerprint(model: nn.Module) -> str:
    """sha256 (16 hex digits) of a strided sample of every layer's q/k/v projection, rounded to bfloat16 so
    that the same checkpoint loaded as float32 or bfloat16 has the same fingerprint."""
    digest = hashlib.sha256()
    for layer in model.layers:
        flat = layer.self_attn.qkv_proj.weight.detach().reshape(-1)
        step = max(1, flat.numel() // FINGERPRINT_SAMPLES)
        sample = flat[::step][:FINGERPRINT_SAMPLES].to(device="cpu", dtype=torch.bfloat16)
        digest.update(sample.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class IndexerSpec:
    identity: ModelIdentity
    index_dim: int  # d: size of an index key and of each index query head
    index_heads: int  # Hi: index query heads

    def to_metadata(self) -> dict[str, str]:
        meta = {k: str(v) for k, v in asdict(self.identity).items()}
        meta.update(format=FORMAT_NAME, version=str(FORMAT_VERSION), index_dim=str(self.index_dim),
                    index_heads=str(self.index_heads))
        return meta

    @classmethod
    def from_metadata(cls, meta: dict[str, str], path: Path) -> IndexerSpec:
        if meta.get("format") != FORMAT_NAME:
            raise IndexerMismatchError(f"{path} is not a glmserve learned-indexer file")
        if meta.get("version") != str(FORMAT_VERSION):
            raise IndexerMismatchError(f"{path} has format version {meta.get('version')}, this glmserve reads "
                                       f"version {FORMAT_VERSION}; train it again with `glmserve train-indexer`")
        values = {}
        for f in fields(ModelIdentity):
            values[f.name] = int(meta[f.name]) if f.type in (int, "int") else meta[f.name]
        return cls(ModelIdentity(**values), int(meta["index_dim"]), int(meta["index_heads"]))


class LearnedIndexerWeights(nn.Module):
    """The scorers of all layers, stacked: wq [layers, H*D, Hi*d], wk [layers, Hkv*D, d], ww [layers, H*D, Hi]."""

    def __init__(self, spec: IndexerSpec):
        super().__init__()
        self.spec = spec
        ident = spec.identity
        q_in, k_in = ident.num_heads * ident.head_dim, ident.num_kv_heads * ident.head_dim
        n, d, hi = ident.num_layers, spec.index_dim, spec.index_heads
        self.wq = nn.Parameter(torch.randn(n, q_in, hi * d) * q_in**-0.5)
        self.wk = nn.Parameter(torch.randn(n, k_in, d) * k_in**-0.5)
        # w starts at 0: scores start flat (the uniform distribution) instead of random and peaked, whose huge
        # first gradients push most relu units negative for good ("dead" content scores in half the layers)
        self.ww = nn.Parameter(torch.zeros(n, q_in, hi))
        self.distance_bias = nn.Parameter(torch.zeros(n, DISTANCE_BUCKETS))
        self.sink_bias = nn.Parameter(torch.zeros(n, SINK_BIAS_TOKENS))
        self.scale = d**-0.5

    def index_keys(self, k: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Post-rope keys [..., T, Hkv, D] -> index keys [..., T, d] (layer None: leading dim is the layer)."""
        wk = self.wk if layer is None else self.wk[layer]
        return torch.matmul(k.flatten(-2).to(wk.dtype), wk)

    def index_queries(self, q: torch.Tensor, layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-rope queries [..., Q, H, D] -> index queries [..., Q, Hi, d] and head weights [..., Q, Hi]."""
        wq, ww = (self.wq, self.ww) if layer is None else (self.wq[layer], self.ww[layer])
        flat = q.flatten(-2).to(wq.dtype)
        qi = torch.matmul(flat, wq).unflatten(-1, (self.spec.index_heads, self.spec.index_dim))
        return qi, torch.matmul(flat, ww)

    def scores(self, qi: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """qi [..., R, Hi, d], w [..., R, Hi]: R query rows sharing keys [..., L, d] -> scores [..., R, L].

        The R rows and Hi heads fold into one matmul against the shared keys (no broadcast copy of them).
        """
        r, hi = qi.shape[-3], qi.shape[-2]
        dots = torch.matmul(qi.flatten(-3, -2), keys.transpose(-1, -2)).unflatten(-2, (r, hi))  # [..., R, Hi, L]
        return torch.matmul((w * self.scale).unsqueeze(-2), torch.relu(dots)).squeeze(-2)  # relu(x)*c = relu(x*c)

    def position_bias(self, query_pos: torch.Tensor, key_pos: torch.Tensor, layer: int | None = None
                      ) -> torch.Tensor:
        """Learned bias by query-key distance bucket and for the first SINK_BIAS_TOKENS positions:
        query_pos [..., R, 1] against key_pos [L] -> [..., R, L] (layer None: a leading layer dim first)."""
        db, sb = (self.distance_bias, self.sink_bias) if layer is None else (self.distance_bias[layer],
                                                                             self.sink_bias[layer])
        bias = db[..., distance_bucket(query_pos - key_pos)]
        sink = key_pos < SINK_BIAS_TOKENS
        return bias + (sb[..., key_pos.clamp(max=SINK_BIAS_TOKENS - 1)] * sink).unsqueeze(-2)

    def save(self, path: Path, extra_metadata: dict[str, str] | None = None) -> None:
        """Atomic write (temp file + rename): a crash never leaves a half-written indexer behind."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {name: p.detach().to("cpu", torch.float32).contiguous() for name, p in self.named_parameters()}
        meta = {**(extra_metadata or {}), **self.spec.to_metadata()}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=meta)
            os.chmod(tmp, 0o644)  # mkstemp's file is private; an indexer is as shareable as the model beside it
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path, expected: ModelIdentity | None = None) -> LearnedIndexerWeights:
        """Reads an indexer file; with `expected`, a file made for another model is an IndexerMismatchError."""
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (OSError, ValueError, SafetensorError) as e:  # missing file, or not safetensors at all
            raise IndexerMismatchError(f"cannot read learned indexer {path}: {e}") from e
        spec = IndexerSpec.from_metadata(meta, path)
        if expected is not None and spec.identity != expected:
            diffs = [f"{f.name} {getattr(spec.identity, f.name)!r} (model: {getattr(expected, f.name)!r})"
                     for f in fields(ModelIdentity) if getattr(spec.identity, f.name) != getattr(expected, f.name)]
            raise IndexerMismatchError(f"learned indexer {path} was trained for another model: " + ", ".join(diffs))
        weights = cls(spec)
        with torch.no_grad():
            for name, p in weights.named_parameters():
                if name not in tensors or tensors[name].shape != p.shape:
                    raise IndexerMismatchError(f"learned indexer {path}: tensor {name!r} missing or of wrong shape")
                p.copy_(tensors[name])
        return weights.requires_grad_(False)


def default_indexer_path(model_path: str | Path | None, fingerprint: str) -> Path:
    """Beside the model: `<dir>/glmserve-indexer.safetensors` for a model directory, `<file>.glmserve-indexer.
    safetensors` beside a single-file model; `indexers/<fingerprint>.safetensors` in glmserve's cache
    (`glmserve.paths.cache_dir`, by default ~/.cache/glmserve) for the embedded model (None: its GGUF lives in
    site-packages, which pip owns) or when the model's directory is not writable."""
    beside = _beside(model_path)
    return beside if beside is not None else _cached_indexers() / f"{fingerprint}.safetensors"


def _beside(model_path: str | Path | None) -> Path | None:
    """The default file beside the model where it is (or can be written) there; None: the cache holds it."""
    if model_path is None:
        return None
    location = Path(model_path)
    beside = location / FILE_SUFFIX if location.is_dir() else location.with_name(f"{location.name}.{FILE_SUFFIX}")
    return beside if beside.exists() or os.access(beside.parent, os.W_OK) else None


def _cached_indexers() -> Path:
    return cache_dir() / "indexers"


def _default_file_may_exist(model_path: str | Path | None) -> bool:
    """Whether `default_indexer_path` can name an existing file, decided without the fingerprint (which
    dequantizes every layer's q/k/v: 1-2 s of each server start): the file beside the model, else any file in
    the cache's indexers/."""
    beside = _beside(model_path)
    if beside is not None:
        return beside.exists()
    cached = _cached_indexers()
    return cached.is_dir() and any(cached.glob("*.safetensors"))


class LearnedIndexer:
    """One layer's learned scorer over its paged pool of index keys; implements
    `glmserve.sparse.indexer.Indexer` at token level (unit_size 1).

    On CPU in float32 the decode scores come from our C++ kernel (glmserve/kernels/csrc/sparse.cpp,
    `learned_scores`), which reads the index keys in place through the block tables; elsewhere one gather of
    the rows' keys and two matmuls compute the same numbers."""

    unit_size = 1

    def __init__(self, weights: LearnedIndexerWeights, layer: int, keys: torch.Tensor, block_size: int):
        self.weights = weights
        self.layer = layer
        self.keys = keys  # [slots, d]: this layer's index key of the token at each cache slot
        self.block_size = block_size

    def on_kv_written(self, slot_mapping: torch.Tensor, k: torch.Tensor, cache: torch.Tensor) -> None:
        self.keys.index_copy_(0, slot_mapping, self.weights.index_keys(k, self.layer).to(self.keys.dtype))

    def unit_scores(self, q: torch.Tensor, rows: ScoringRows) -> torch.Tensor:
        """q [B, H, D] -> [B, L] score of every key position of each row (-inf past its context)."""
        qi, w = self.weights.index_queries(q, self.layer)  # [B, Hi, d], [B, Hi]
        length = rows.kv_slots.shape[1]
        learned_scores = kernels.op("learned_scores", self.keys.device, qi.dtype)
        if learned_scores is not None:  # reads the index keys in place: no [B, L, d] gather copy
            return learned_scores(
                qi.contiguous(), (w * self.weights.scale).contiguous(), self.keys, rows.block_tables.contiguous(),
                self.block_size, length, rows.context_lens.contiguous(),
                self.weights.distance_bias[self.layer].float().contiguous(),
                self.weights.sink_bias[self.layer].float().contiguous())
        keys = self.keys[rows.kv_slots].to(qi.dtype)  # [B, L, d] (index_select measured no faster on CPU)
        key_pos = positions_upto(length, keys.device)
        scores = self.weights.scores(qi.unsqueeze(1), w.unsqueeze(1), keys).squeeze(1)
        scores += self.weights.position_bias((rows.context_lens - 1)[:, None], key_pos, self.layer)
        past_context = key_pos[None, :] >= rows.context_lens[:, None]
        return scores.masked_fill_(past_context, float("-inf"))


def index_key_bytes_per_token(weights: LearnedIndexerWeights) -> int:
    """Bytes of index keys per token over all layers (the extra paged pool)."""
    spec = weights.spec
    return spec.identity.num_layers * spec.index_dim * torch.empty((), dtype=INDEX_KEY_DTYPE).element_size()


class IndexKeyPool:
    """The paged pool of index keys ([layers, slots, d]) beside a model's KV pool."""

    def __init__(self, weights: LearnedIndexerWeights, kv_cache: torch.Tensor, block_size: int):
        self.weights = weights
        self.kv_cache = kv_cache  # [layers, 2, kv_heads, slots, head_dim]
        self.block_size = block_size
        num_slots = kv_cache.shape[3]
        self.keys = torch.empty((weights.spec.identity.num_layers, num_slots, weights.spec.index_dim),
                                dtype=INDEX_KEY_DTYPE, device=kv_cache.device)
        self.keys[:, :block_size].zero_()  # the null block that padded slot indices point at

    @torch.no_grad()
    def refresh(self, blocks: torch.Tensor) -> None:
        """Recomputes the index keys of `blocks` from their K in the KV pool, for KV loaded into the pool
        without passing through attention (tiers, sessions: `KVBlockIO.add_load_listener`)."""
        offsets = torch.arange(self.block_size, device=self.kv_cache.device)
        slots = (blocks.to(self.kv_cache.device)[:, None] * self.block_size + offsets).reshape(-1)
        k = dequantize(self.kv_cache[:, 0].index_select(2, slots), torch.float32).transpose(1, 2)  # [layers, n, Hkv, D]
        self.keys.index_copy_(1, slots, self.weights.index_keys(k).to(self.keys.dtype))


def attach_learned_indexers(layers: Sequence[ScoredLayer], weights: LearnedIndexerWeights, kv_cache: torch.Tensor,
                            block_size: int) -> IndexKeyPool:
    """Allocates the index-key pool beside `kv_cache` and gives each of a model's paged attention `layers` its
    LearnedIndexer (mode "learned")."""
    weights.to(kv_cache.device)
    pool = IndexKeyPool(weights, kv_cache, block_size)
    attach_indexers(layers, "learned", lambda i, layer: LearnedIndexer(weights, i, pool.keys[i], block_size))
    return pool


def find_learned_indexer(option: str | None, model_path: str | None, model: nn.Module
                         ) -> LearnedIndexerWeights | None:
    """The engine's learned indexer: `option` a file path (must exist and match), "none" (off), or None:
    the default file of the model (`default_indexer_path`; model_path None = the embedded model) when
    there is one. Models without paged attention layers (MLA) take none."""
    scored = model.paged_attention_layers()
    if option == "none" or (option is None and not scored):
        return None
    if not scored:
        raise IndexerMismatchError(f"{type(model).__name__} has no paged attention layers for a learned indexer")
    if option is None and not _default_file_may_exist(model_path):
        return None
    identity = ModelIdentity.of(model)
    if option is None:
        path = default_indexer_path(model_path, identity.fingerprint)
        if not path.exists():
            return None
    else:
        path = Path(option)
    return LearnedIndexerWeights.load(path, expected=identity)
