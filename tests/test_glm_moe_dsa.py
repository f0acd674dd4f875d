"""GLM-5.x (`GlmMoeDsaForCausalLM`) and DeepSeek-V3.2 against transformers' own models on tiny random
configs whose contexts are far longer than `index_topk`, so that attention is really sparse:

- logprobs of every prefill's last position and of every paged incremental decode step, with several
  sequences of different lengths in one batch, chunked prefill and prefix-cache hits;
- the key positions the lightning indexer selects, per layer and per query, against the reference
  indexer's top-k on the same sequence (prefill in chunks, decode, and a prefix-cache hit).

The indexer uses 16 heads: with few heads, `sum_h w_h * relu(q_h . k)` is exactly 0 for many keys
(every head's dot product negative), and top-k among exact ties is arbitrary in any implementation.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from parity import check_two_waves
from tiny_models import tiny_tokenizer
from transformers import AutoModelForCausalLM, DeepseekV32Config, GlmMoeDsaConfig

from glmserve import LLM, SamplingParams

TOPK = 8

COMMON = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
    n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
    index_topk=TOPK, index_n_heads=16, index_head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=1,
)

CONFIGS = {
    # layer 1 reuses layer 0's selection (IndexShare); layer 2 runs its own indexer
    "glm_moe_dsa": lambda: GlmMoeDsaConfig(**COMMON, indexer_types=["full", "shared", "full"]),
    # every layer runs its indexer; yarn rope with mscale_all_dim (as DeepSeek ships it)
    "deepseek_v32": lambda: DeepseekV32Config(**COMMON, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
}


def make_model(arch: str, out_dir: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    config = CONFIGS[arch]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init; norms, biases, router bias not trivial
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            else:
                p.normal_(1, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    model.save_pretrained(out_dir)
    tiny_tokenizer(config.vocab_size).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    path = make_model(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"))
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf_model


def _prompts(vocab: int, lengths, gen: torch.Generator) -> list[list[int]]:
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]


def test_logits_match_transformers(tiny):
    path, hf_model = tiny
    # float32 latents (the CPU default is bf16): compared with transformers' float32 model at float32 tolerances
    llm = LLM(model=str(path), block_size=4, max_num_batched_tokens=24, max_num_seqs=8,
              kv_cache_memory_bytes=4 << 20, kv_cache_dtype="float32")
    check_two_waves(llm, hf_model, (5, 17, 41, 60))


def _reference_selections(hf_model, tokens: list[int]) -> dict[int, torch.Tensor]:
    """Layer index -> the reference indexer's top-k key positions per query, [S, topk]."""
    found: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(hf_model.model.layers):
        if layer.self_attn.indexer is not None:
            hooks.append(layer.self_attn.indexer.register_forward_hook(
                lambda _m, _a, out, i=i: found.__setitem__(i, out[0].long())))
    try:
        with torch.no_grad():
            hf_model(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    return found


def test_selected_positions_match_reference(tiny):
    path, hf_model = tiny
    llm = LLM(model=str(path), block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
              kv_cache_memory_bytes=4 << 20, kv_cache_dtype="float32")  # the float32 reference's top-k
    model = llm.engine.runner.model
    records: list[tuple[int, torch.Tensor, object]] = []
    model.selection_observer = lambda layer, pos, sel: records.append((layer, pos.clone(), sel))
    gen = torch.Generator().manual_seed(2)
    vocab = hf_model.config.vocab_size
    prompt = _prompts(vocab, [45], gen)[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # a long prompt in chunks of 16, its decode steps, then a prompt extending it (prefix-cache hit)
    waves = [prompt, prompt + _prompts(vocab, [9], gen)[0]]
    num_sparse = 0
    for wave, wave_prompt in enumerate(waves):
        records.clear()
        out = llm.generate([wave_prompt], params)[0]
        if wave:
            assert out.num_cached_tokens >= 40
        full = wave_prompt + out.outputs[0].token_ids
        ref = _reference_selections(hf_model, full[:-1])  # the last token was sampled, never run
        layers = {layer for layer, _, _ in records}
        assert layers == set(ref), (layers, set(ref))
        seen = set()
        for layer, positions, sel in records:
            for row, pos in enumerate(positions.tolist()):
                expected = {p for p in ref[layer][pos].tolist() if p <= pos}
                if sel.positions is None:
                    ours = set(range(pos + 1))
                else:
                    ours = set(sel.positions[row][sel.valid[row]].tolist())
                    num_sparse += pos + 1 > TOPK
                assert len(ours) == min(pos + 1, TOPK) or sel.positions is None
                assert ours == expected, (wave, layer, pos, sorted(ours), sorted(expected))
                seen.add((layer, pos))
        assert {pos for _, pos in seen} == set(range(out.num_cached_tokens, len(full) - 1))
    assert num_sparse > 100  # most queries really were sparse


def test_load_weights_accepts_3d_experts_and_skips_mtp_layer(tiny):
    """transformers' in-memory layout (experts as 3D tensors) loads too; the layer past num_hidden_layers
    (GLM-5's MTP layer) is skipped; a missing tensor is an error."""
    path, hf_model = tiny
    llm = LLM(model=str(path), block_size=4, kv_cache_memory_bytes=1 << 20)
    loaded = llm.engine.runner.model
    cls, config = type(loaded), hf_model.config
    state = hf_model.state_dict()
    assert any(n.endswith("experts.gate_up_proj") for n in state)
    fresh = cls(config, config.max_position_embeddings)
    extra = [(f"model.layers.{config.num_hidden_layers}.eh_proj.weight", torch.zeros(2, 2))]
    fresh.load_weights(list(state.items()) + extra)
    for (name, a), (_, b) in zip(loaded.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="lacks"):
        cls(config, config.max_position_embeddings).load_weights(
            (n, t) for n, t in state.items() if not n.endswith("kv_b_proj.weight"))
