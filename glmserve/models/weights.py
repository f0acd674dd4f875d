"""The weight loader: checkpoint tensors (Hugging Face names) into a model's parameters, one at a time.

Every model declares once, as `checkpoint_layout`, how its checkpoints name what it fuses (q|k|v into
qkv_proj, gate|up into gate_up_proj, per-expert matrices into 3D expert tensors). `load_weights` maps
each checkpoint tensor to (our parameter, `Shard`) and hands it to the module that owns the parameter
(glmserve/layers/param_loading.py: its own `load_parameter` if it has one, else a plain copy). Quantized
modules (`HoldsWeights`) hold weights that are no parameters: they are filled the same way under the same
names, then finalized (repacked for their backend) once every tensor is in.
Hugging Face safetensors and GGUF checkpoints (glmserve/models/gguf_loader.py yields Hugging Face
names) both load through here.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from glmserve.layers.embedding import QuantizedEmbedding
from glmserve.layers.param_loading import (
    WHOLE,
    CheckpointTensor,
    HoldsWeights,
    LoadsParameters,
    Shard,
    load_whole,
    numel,
)

_PLACEHOLDERS = {"{kind}": r"(?P<kind>weight|bias)", "{expert}": r"(?P<expert>\d+)"}
_LAYER_INDEX = re.compile(r"^layers\.(\d+)\.")


@dataclass(frozen=True)
class _FusedRule:
    pattern: re.Pattern
    target: str
    part: int | None

    def place(self, name: str) -> tuple[str, Shard] | None:
        m = self.pattern.match(name)
        if m is None:
            return None
        expert = m.groupdict().get("expert")
        target = m["prefix"] + self.target.format(kind=m.groupdict().get("kind"))
        return target, Shard(self.part, None if expert is None else int(expert))


@dataclass(frozen=True)
class CheckpointLayout:
    """How a model's checkpoints name its parameters, declared once per model class.

    fused: checkpoint tensor -> (our parameter, part of it; None: all of it), both as name suffixes with
    the placeholders `{kind}` (weight or bias) and `{expert}` (an expert's index: the shard's expert).
    A rule applies only where its parameter exists; a name that no rule maps is our parameter's name.
    skip_layers_beyond_config: layers past num_hidden_layers (GLM-5's MTP layer) are not loaded.
    """

    fused: Mapping[str, tuple[str, int | None]] = field(default_factory=dict)
    skip_layers_beyond_config: bool = False
    _rules: tuple[_FusedRule, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        rules = []
        for source, (target, part) in self.fused.items():
            regex = re.escape(source)
            for placeholder, group in _PLACEHOLDERS.items():
                regex = regex.replace(re.escape(placeholder), group)
            rules.append(_FusedRule(re.compile(rf"(?P<prefix>(?:.*\.)?){regex}$"), target, part))
        object.__setattr__(self, "_rules", tuple(rules))

    def place(self, name: str, params: Mapping[str, object]) -> tuple[str, Shard]:
        """(our parameter, shard) for the checkpoint tensor `name` (without the `model.` prefix)."""
        for rule in self._rules:
            placed = rule.place(name)
            if placed is not None and placed[0] in params:
                return placed
        return name, WHOLE


class LoadsCheckpoint:
    """Mixin of our causal LMs: `load_weights` fills every parameter from Hugging Face-named tensors."""

    checkpoint_layout: ClassVar[CheckpointLayout] = CheckpointLayout()

    def load_weights(self: nn.Module, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Loads every parameter (and every quantized module's weights) exactly once, as `checkpoint_layout`
        says; a tensor with no place in the model, a shape mismatch and a parameter left (partly) unfilled
        are errors. Ties lm_head to the embedding first where the config says so; finalizes each quantized
        module once its slots are filled (the others, e.g. a tied head, last)."""
        layout = self.checkpoint_layout
        if self._ties_word_embeddings():
            self._tie_lm_head()
        params = dict(self.named_parameters())
        holders = {name: m for name, m in self.named_modules() if isinstance(m, HoldsWeights)}
        slots = {f"{prefix}.{local}": count
                 for prefix, m in holders.items() for local, count in m.weight_slots().items()}
        expected = {n: p.numel() for n, p in params.items()} | slots
        filled: Counter[str] = Counter()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if self._not_ours(name):
                continue
            target, shard = layout.place(name, expected)
            if target not in expected:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            owner_name, _, local = target.rpartition(".")
            owner = self.get_submodule(owner_name)
            try:
                if target in slots:
                    owner.load_weight(local, tensor, shard)
                elif isinstance(tensor, torch.Tensor):
                    load = owner.load_parameter if isinstance(owner, LoadsParameters) else load_whole
                    load(params[target], tensor, shard)
                else:
                    raise ValueError(f"a quantized tensor ({tensor.spec}) for the float parameter {target}")
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from exc
            filled[target] += numel(tensor)
            if target in slots and all(filled[f"{owner_name}.{slot}"] == count
                                       for slot, count in owner.weight_slots().items()):
                owner.finalize()  # repacked now, its checkpoint parts freed: the load's peak holds one module's
        wrong = [n for n, count in expected.items() if filled[n] != count]
        if wrong:
            raise ValueError(f"checkpoint lacks (or repeats) {len(wrong)} tensors, e.g. {wrong[:5]}")
        for module in holders.values():
            module.finalize()

    def _tie_lm_head(self: nn.Module) -> None:
        """lm_head shares the embedding's weight: the same parameter (float) or the same quantized bytes."""
        if isinstance(self.embed_tokens, QuantizedEmbedding):
            self.embed_tokens.tie(self.lm_head)
        elif isinstance(self.lm_head, HoldsWeights):
            raise ValueError("a quantized lm_head cannot be tied to a float embedding")
        else:
            self.lm_head.weight = self.embed_tokens.weight

    def _not_ours(self, name: str) -> bool:
        """Tensors a checkpoint may hold that are no parameters of ours."""
        if "rotary_emb." in name:  # rotary buffers some checkpoints save; our tables are computed
            return True
        if name == "lm_head.weight" and self._ties_word_embeddings():
            return True
        layer = _LAYER_INDEX.match(name)
        return (self.checkpoint_layout.skip_layers_beyond_config and layer is not None
                and int(layer.group(1)) >= self.config.num_hidden_layers)

    def _ties_word_embeddings(self) -> bool:
        """The one place where lm_head and the embedding are tied (a model built on the meta device and
        moved by `to_empty` holds two tensors again, so tying belongs to loading, not to construction)."""
        return bool(getattr(self.config, "tie_word_embeddings", False))
