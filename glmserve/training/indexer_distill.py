"""Distills a learned indexer (glmserve/sparse/learned.py) from the model's own dense attention.

Teacher: our model code run densely over windows of the user's text, with each layer's paged attention
swapped for a recorder that runs causal SDPA and keeps the layer's post-rope queries (of a sample of query
positions) and keys. Target per sampled query: the head-averaged dense attention distribution over its
past tokens. Loss: KL(target || softmax(scores)) averaged over queries and layers, Adam in float32; every
layer's scorer trains in the same batched matmuls (the layers do not interact).

Evaluation at a token budget k: the share of the dense attention mass (head-averaged) that falls on the
indexer's top-k tokens, per query with more than k past tokens, averaged per layer and then over layers;
against the same k chosen by recency (the last k), by sinks + recency (4 first + the last k - 4), at
random (expected share k / context), and by the target itself (the best any k-token set can do).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from glmserve.errors import InvalidRequestError
from glmserve.sparse.learned import IndexerSpec, LearnedIndexerWeights, ModelIdentity, default_indexer_path

SINK_TOKENS = 4  # the sinks + recency baseline keeps this many first tokens


@dataclass
class DistillConfig:
    window: int = 2048  # tokens per teacher window
    steps: int = 300
    dim: int = 32  # index key / index query head size
    heads: int = 4  # index query heads
    lr: float = 3e-3
    queries_per_window: int = 256  # sampled query positions per window, from window // 2 on
    queries_per_step: int = 128
    max_windows: int = 12
    heldout_windows: int = 2  # the text's last windows, never trained on
    budget: int = 256  # token budget of the recall metric
    seed: int = 0

    def validate(self) -> None:
        for name in ("window", "steps", "dim", "heads", "queries_per_window", "queries_per_step", "max_windows",
                     "budget"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.window < 8:
            raise InvalidRequestError(f"window must be >= 8 tokens, got {self.window}")
        if self.budget < 2 * SINK_TOKENS:
            raise InvalidRequestError(f"budget must be >= {2 * SINK_TOKENS} tokens, got {self.budget}")
        if not 0 <= self.heldout_windows < self.max_windows:
            raise InvalidRequestError("heldout_windows must be >= 0 and below max_windows")


@dataclass
class TeacherWindow:
    """One window's teacher data, every layer stacked on the leading dim."""

    q: torch.Tensor  # [layers, Q, H, D] post-rope queries of the sampled positions
    k: torch.Tensor  # [layers, T, Hkv, D] post-rope keys of the whole window
    target: torch.Tensor  # [layers, Q, T] head-averaged dense attention (zero past each query)
    query_pos: torch.Tensor  # [Q] positions of the sampled queries

    def subset(self, rows: torch.Tensor) -> TeacherWindow:
        return TeacherWindow(self.q[:, rows], self.k, self.target[:, rows], self.query_pos[rows])


class _DenseRecorder:
    """Stands in for a layer's PagedAttention during distillation: causal SDPA over the window, keeping
    the post-rope keys, the sampled queries and their head-averaged attention distributions."""

    def __init__(self, attn, query_pos: torch.Tensor):
        self.attn = attn
        self.query_pos = query_pos
        self.q = self.k = self.target = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        a = self.attn
        gqa = a.num_heads != a.num_kv_heads
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True, scale=a.scale, enable_gqa=gqa)
        qs = q[self.query_pos].float()  # [Q, H, D]
        keys = k.float().repeat_interleave(a.num_heads // a.num_kv_heads, dim=1)  # [T, H, D]
        logits = torch.einsum("qhd,thd->hqt", qs, keys) * a.scale
        future = torch.arange(k.shape[0], device=k.device)[None, :] > self.query_pos[:, None]
        self.target = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1).mean(0)
        self.q, self.k = qs, k.float()
        return out[0].transpose(0, 1).reshape(q.shape[0], a.num_heads * a.head_dim).to(out_dtype or q.dtype)


@contextmanager
def _recording(model: nn.Module, query_pos: torch.Tensor) -> Iterator[list[_DenseRecorder]]:
    attns = [layer.self_attn for layer in model.layers]
    originals = [a.attn for a in attns]
    recorders = [_DenseRecorder(orig, query_pos) for orig in originals]
    try:
        for a, r in zip(attns, recorders):
            a.attn = r
        yield recorders
    finally:
        for a, orig in zip(attns, originals):
            a.attn = orig


@torch.no_grad()  # not inference_mode: the tensors feed autograd in training
def teacher_window(model: nn.Module, token_ids: torch.Tensor, query_pos: torch.Tensor) -> TeacherWindow:
    """Runs the model densely over one window of token ids and returns its teacher data."""
    positions = torch.arange(token_ids.shape[0])
    with _recording(model, query_pos) as recorders:
        model(token_ids, positions, None, positions[-1:])
    return TeacherWindow(torch.stack([r.q for r in recorders]), torch.stack([r.k for r in recorders]),
                         torch.stack([r.target for r in recorders]), query_pos)


def text_windows(token_ids: list[int], window: int, max_windows: int) -> list[torch.Tensor]:
    """Consecutive, non-overlapping windows of the token stream (at most max_windows)."""
    count = min(len(token_ids) // window, max_windows)
    return [torch.tensor(token_ids[i * window:(i + 1) * window]) for i in range(count)]


def scores_of(weights: LearnedIndexerWeights, w: TeacherWindow) -> torch.Tensor:
    """Indexer scores of every sampled query against the window's keys, future masked: [layers, Q, T]."""
    keys = weights.index_keys(w.k)  # [layers, T, d]
    qi, hw = weights.index_queries(w.q)  # [layers, Q, Hi, d], [layers, Q, Hi]
    key_pos = torch.arange(w.k.shape[1])
    s = weights.scores(qi, hw, keys) + weights.position_bias(w.query_pos[:, None], key_pos)
    return s.masked_fill(key_pos[None, :] > w.query_pos[:, None], float("-inf"))


def kl_per_layer(weights: LearnedIndexerWeights, w: TeacherWindow) -> torch.Tensor:
    """KL(target || softmax(scores)) per layer, averaged over the window's queries: [layers]."""
    logp = torch.log_softmax(scores_of(weights, w), dim=-1)
    past = torch.isfinite(logp)
    cross = -(w.target * torch.where(past, logp, 0.0)).sum(-1)
    entropy = -torch.special.xlogy(w.target, w.target).sum(-1)
    return (cross - entropy).mean(-1)


@dataclass
class RecallReport:
    """Attention mass recall at a budget, per layer (each a list over layers) and averaged."""

    budget: int
    num_queries: int  # queries per window with more past tokens than the budget
    indexer: list[float]
    indexer_in_window: list[float]  # the engine's rule: 4 sinks + the last budget/4 kept, the indexer the rest
    oracle: list[float]
    recency: list[float]
    sinks_recency: list[float]
    random: list[float]

    def mean(self) -> dict[str, float]:
        return {name: sum(v) / len(v) for name, v in vars(self).items() if isinstance(v, list)}


@torch.no_grad()
def recall_at_budget(weights: LearnedIndexerWeights, windows: list[TeacherWindow], budget: int) -> RecallReport:
    """Share of dense attention mass on each selection of `budget` tokens (queries with longer contexts)."""
    sums: dict[str, torch.Tensor] = {}
    count = 0
    for w in windows:
        rows = (w.query_pos + 1 > budget).nonzero()[:, 0]
        if rows.numel() == 0:
            continue
        sub = w.subset(rows)
        t, ctx = sub.target, (sub.query_pos + 1).float()  # [layers, Q, T], [Q]
        key_pos = torch.arange(t.shape[-1])
        recent = key_pos[None, :] > sub.query_pos[:, None] - budget  # last `budget` past tokens (future has 0)
        sinks = key_pos[None, :] < SINK_TOKENS
        sinks_recent = sinks | (key_pos[None, :] > sub.query_pos[:, None] - (budget - SINK_TOKENS))
        scores = scores_of(weights, sub)
        local = budget // 4
        window = sinks | (key_pos[None, :] > sub.query_pos[:, None] - local)  # kept anyway; future has 0
        fill = scores.masked_fill(window, float("-inf")).topk(budget - SINK_TOKENS - local, dim=-1).indices
        got = {
            "indexer": t.gather(-1, scores.topk(budget, dim=-1).indices).sum(-1),
            "indexer_in_window": (t * window).sum(-1) + t.gather(-1, fill).sum(-1),
            "oracle": t.topk(budget, dim=-1).values.sum(-1),
            "recency": (t * recent).sum(-1),
            "sinks_recency": (t * sinks_recent).sum(-1),
            "random": (budget / ctx).expand_as(t[..., 0]),
        }
        for name, v in got.items():
            sums[name] = sums.get(name, 0) + v.sum(-1)
        count += rows.numel()
    if count == 0:
        raise InvalidRequestError(f"no query has more than {budget} past tokens; use a longer window")
    per_layer = {name: (v / count).tolist() for name, v in sums.items()}
    return RecallReport(budget, count // len(windows), **per_layer)


@dataclass
class DistillReport:
    steps: int
    train_windows: int
    heldout_windows: int
    window: int
    loss_history: list[float] = field(default_factory=list)  # training KL every `log_every` steps
    train_kl_before: float = math.nan
    train_kl: float = math.nan
    heldout_kl_before: float = math.nan
    heldout_kl: float = math.nan
    recall: dict[str, float] = field(default_factory=dict)  # held-out (train when none held out), layer mean
    recall_per_layer: dict[str, list[float]] = field(default_factory=dict)
    teacher_seconds: float = 0.0
    train_seconds: float = 0.0


@torch.no_grad()
def mean_kl(weights: LearnedIndexerWeights, windows: list[TeacherWindow]) -> float:
    return float(torch.stack([kl_per_layer(weights, w).mean() for w in windows]).mean()) if windows else math.nan


def distill(model: nn.Module, token_ids: list[int], cfg: DistillConfig,
            log: Callable[[str], None] = lambda _: None) -> tuple[LearnedIndexerWeights, DistillReport]:
    """Trains a learned indexer for `model` on a token stream; returns the weights and the report."""
    cfg.validate()
    windows = text_windows(token_ids, cfg.window, cfg.max_windows)
    if len(windows) <= cfg.heldout_windows:
        raise InvalidRequestError(
            f"the text has {len(token_ids)} tokens: {len(windows)} window(s) of {cfg.window}, need more than "
            f"{cfg.heldout_windows} (held out); give more text or a smaller --window")
    gen = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    start = time.perf_counter()
    first = cfg.window // 2
    teacher = []
    for i, ids in enumerate(windows):
        num = min(cfg.queries_per_window, cfg.window - first)
        query_pos = (first + torch.randperm(cfg.window - first, generator=gen)[:num]).sort().values
        teacher.append(teacher_window(model, ids, query_pos))
        log(f"teacher window {i + 1}/{len(windows)} ({time.perf_counter() - start:.1f} s)")
    split = len(teacher) - cfg.heldout_windows
    train, heldout = teacher[:split], teacher[split:]
    teacher_seconds = time.perf_counter() - start

    weights = LearnedIndexerWeights(IndexerSpec(ModelIdentity.of(model), cfg.dim, cfg.heads))
    report = DistillReport(cfg.steps, len(train), len(heldout), cfg.window, teacher_seconds=teacher_seconds,
                           train_kl_before=mean_kl(weights, train), heldout_kl_before=mean_kl(weights, heldout))
    opt = torch.optim.Adam(weights.parameters(), lr=cfg.lr)
    log_every = max(1, cfg.steps // 10)
    start = time.perf_counter()
    running = []
    for step in range(cfg.steps):
        w = train[step % len(train)]
        rows = torch.randperm(w.query_pos.numel(), generator=gen)[:cfg.queries_per_step]
        loss = kl_per_layer(weights, w.subset(rows)).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        running.append(float(loss.detach()))
        if (step + 1) % log_every == 0:
            report.loss_history.append(sum(running) / len(running))
            running.clear()
            log(f"step {step + 1}/{cfg.steps}: train KL {report.loss_history[-1]:.4f} "
                f"({time.perf_counter() - start:.1f} s)")
    report.train_seconds = time.perf_counter() - start
    weights.requires_grad_(False)
    report.train_kl, report.heldout_kl = mean_kl(weights, train), mean_kl(weights, heldout)
    recall = recall_at_budget(weights, heldout or train, cfg.budget)
    report.recall, report.recall_per_layer = recall.mean(), {k: v for k, v in vars(recall).items()
                                                             if isinstance(v, list)}
    return weights, report


def read_texts(paths: list[str]) -> str:
    """The training text: the files' contents, one after another."""
    parts = []
    for p in paths:
        try:
            parts.append(Path(p).read_text(encoding="utf-8", errors="replace"))
        except OSError as e:
            raise InvalidRequestError(f"cannot read training text {p}: {e.strerror or e}") from e
    return "\n\n".join(parts)


def train_and_save(model_path: str | None, text_paths: list[str], out: str | None, cfg: DistillConfig,
                   log: Callable[[str], None] = lambda _: None,
                   quantization: str | None = None) -> tuple[Path, DistillReport]:
    """`glmserve train-indexer`: distills an indexer for a model (None = the embedded SmolLM2) on CPU in
    float32 and saves it, by default where the engine finds it (`default_indexer_path`)."""
    from glmserve.models.loader import load_model

    cfg.validate()
    text = read_texts(text_paths)
    loaded = load_model(model_path, None, torch.device("cpu"), torch.float32, quantization)
    if cfg.window > loaded.max_position_embeddings:
        raise InvalidRequestError(f"window {cfg.window} is longer than the model's context "
                                  f"{loaded.max_position_embeddings}")
    token_ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    log(f"{len(token_ids)} tokens of text; teacher: {loaded.name}, {len(loaded.model.layers)} layers; {cfg}")
    weights, report = distill(loaded.model, token_ids, cfg, log)
    path = Path(out) if out else default_indexer_path(model_path, weights.spec.identity.fingerprint)
    source = str(Path(model_path).resolve()) if model_path else f"embedded:{loaded.name}"
    weights.save(path, {"model": source, "report": json.dumps(asdict(report))})
    return path, report
