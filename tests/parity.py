"""Comparison against transformers' reference model, shared by the architecture parity tests."""

from __future__ import annotations

import torch

TOL = 2e-4


def smollm2_reference():
    """transformers' model of the embedded SmolLM2 GGUF's weights (fp32), in eval mode."""
    from transformers import AutoModelForCausalLM

    from glmserve.models.gguf_loader import embedded_default_gguf, load_gguf

    ckpt = load_gguf(embedded_default_gguf())
    model = AutoModelForCausalLM.from_config(ckpt.config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(dict(ckpt.tensors()), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model.eval()


def reference_logprobs(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_against_reference(hf_model, prompt: list[int], output, tol: float = TOL) -> float:
    """Every reported top logprob of every generated step within `tol` of the reference; greedy
    choices agree unless the reference's top two are a near-tie. Returns the largest error."""
    ref = reference_logprobs(hf_model, prompt + output.token_ids)
    worst = 0.0
    for step, lp in enumerate(output.logprobs):
        row = ref[len(prompt) - 1 + step]
        for token_id, value in lp.top:
            err = abs(row[token_id].item() - value)
            worst = max(worst, err)
            assert err < tol, (step, token_id, row[token_id].item(), value)
        best = row.topk(2)
        if best.values[0] - best.values[1] > tol:
            assert lp.token_id == best.indices[0].item(), step
    return worst


def check_two_waves(llm, hf_model, first_lengths, tol: float = TOL, seed: int = 1) -> None:
    """First wave: random prompts of `first_lengths` plus a shared 30-token prompt, batched; second wave:
    prompts extending the shared one, which hit the prefix cache. Every step is checked against the
    reference and no KV block leaks."""
    from glmserve import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    vocab = hf_model.config.vocab_size

    def prompts(lengths):
        return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]

    shared = prompts([30])[0]
    first = prompts(first_lengths) + [shared]
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=5)
    for prompt, out in zip(first, llm.generate(first, params)):
        assert out.num_cached_tokens == 0
        check_against_reference(hf_model, prompt, out.outputs[0], tol)
    second = [shared + p for p in prompts((3, 11))] + [shared]
    for prompt, out in zip(second, llm.generate(second, params)):
        assert out.num_cached_tokens >= 28, out.num_cached_tokens
        check_against_reference(hf_model, prompt, out.outputs[0], tol)
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


def assert_same_output(got, want, tol: float = 1e-4) -> None:
    """Two runs of one request: the same tokens, logprobs within `tol`, the same top-token lists."""
    a, b = got.outputs[0], want.outputs[0]
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        assert abs(x.logprob - y.logprob) < tol
        assert [t for t, _ in x.top] == [t for t, _ in y.top]


def reference_decode(q, k, v, slots, lengths, scale):
    """Decode attention in float64, row by row, over k/v [Hkv, slots, D] at `slots` [B, L] (the first `lengths`):
    (out [B, H, D], log-sum-exp [B, H]) in float32; the oracle of the decode kernels' tests."""
    outs, lses = [], []
    g = q.shape[1] // k.shape[0]
    for row in range(q.shape[0]):
        idx = slots[row, :lengths[row]]
        kr, vr = k[:, idx].double().repeat_interleave(g, 0), v[:, idx].double().repeat_interleave(g, 0)
        s = torch.einsum("hd,hld->hl", q[row].double(), kr) * scale
        outs.append(torch.einsum("hl,hld->hd", torch.softmax(s, -1), vr))
        lses.append(torch.logsumexp(s, -1))
    return torch.stack(outs).float(), torch.stack(lses).float()
