"""A function-preserving rotation of the residual stream of a pre-norm decoder (the R1 rotation of QuaRot, Ashkboos
et al. 2024, arXiv 2404.00456, section 4, and SpinQuant, Liu et al. 2024, arXiv 2405.16406, section 3.1), applied to
a float transformers model before quantization.

Every RMSNorm's weight g is folded into the linear layers that read the norm (q/k/v after input_layernorm, gate/up
after post_attention_layernorm, lm_head after the final norm; lm_head is untied from the embedding first), so every
norm computes x / rms(x). Then the residual stream h becomes h Q for an orthogonal Q [hidden, hidden]: the
embedding E -> E Q, every linear reading the stream W -> W Q, every linear writing to it (o_proj, down_proj) W -> Q^T W
(and its bias b -> b Q). rms(x Q) = rms(x) because Q keeps norms, so the model computes the same function (to float
rounding) while its weights lose their outlier input channels, which is what 4-bit and FP8 rounding gain from.

Q is a randomized Hadamard matrix H diag(s) / sqrt(n) (random signs s; QuaRot's choice) where a Hadamard matrix of
order n is built here: n = 2^k (Sylvester) or n = 2^k (q + 1) with q a prime, q = 3 mod 4 (Paley's first
construction times Sylvester's; SmolLM2's 576 = 8 x 72, q = 71). Else, or when asked, a seeded random orthogonal
matrix (QR of a Gaussian with the signs fixed: Haar-distributed; Mezzadri 2007, arXiv math-ph/0609050).
"""

from __future__ import annotations

import torch

from glmserve.errors import InvalidRequestError, UnsupportedModelError

KINDS = ("auto", "hadamard", "random")
# transformers model types whose decoder layers are pre-norm with one norm before attention and one before the
# MLP, and nothing between a sublayer's output and the residual add (Glm4's post-sublayer norms would break it)
PRE_NORM_TYPES = ("llama", "mistral", "qwen2", "qwen3")
READERS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}
WRITERS = ("self_attn.o_proj", "mlp.down_proj")


def _prime(q: int) -> bool:
    return q > 1 and all(q % d for d in range(2, int(q ** 0.5) + 1))


def _paley_order(n: int) -> int | None:
    """The Paley factor m = q + 1 (q prime, q = 3 mod 4) with n = 2^k m, 1 for a power of two, None if neither."""
    while n > 1:
        if _prime(n - 1) and (n - 1) % 4 == 3:
            return n
        if n % 2:
            return None
        n //= 2
    return 1


def hadamard(n: int) -> torch.Tensor:
    """A Hadamard matrix of order n (entries +-1, H H^T = n I), float64; InvalidRequestError where none is built."""
    m = _paley_order(n)
    if m is None:
        raise InvalidRequestError(f"no Hadamard matrix of order {n} is built here (orders 2^k and 2^k (q + 1), q a "
                                  "prime = 3 mod 4); use the random rotation")
    h = torch.ones(1, 1, dtype=torch.float64)
    if m > 1:  # Paley I: H = I + S, S = [[0, 1^T], [-1, Jacobsthal(q)]], antisymmetric for q = 3 mod 4
        q = m - 1
        residues = {(i * i) % q for i in range(1, q)}
        d = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
        chi = torch.where(d == 0, 0.0, torch.where(torch.isin(d, torch.tensor(sorted(residues))), 1.0, -1.0))
        s = torch.zeros(m, m, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, chi.double()
        h = torch.eye(m, dtype=torch.float64) + s
    sylvester = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(sylvester, h)
    return h


def rotation(n: int, kind: str = "auto", seed: int = 0) -> torch.Tensor:
    """An orthogonal [n, n] float64 matrix: a randomized Hadamard (`hadamard`; `auto` where one is built) or a
    Haar-random orthogonal (`random`; `auto` elsewhere), from `seed`."""
    if kind not in KINDS:
        raise InvalidRequestError(f"rotation {kind!r} is not one of {', '.join(KINDS)}")
    gen = torch.Generator().manual_seed(seed)
    if kind == "hadamard" or (kind == "auto" and _paley_order(n) is not None):
        signs = torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1
        return hadamard(n) * signs / n ** 0.5
    g = torch.randn(n, n, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    return q * torch.sign(torch.diagonal(r))


def _set(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    param.data = value.to(param.dtype).contiguous()


@torch.no_grad()
def rotate_model(model: torch.nn.Module, kind: str = "auto", seed: int = 0) -> torch.Tensor:
    """Fold the norms and rotate the residual stream of a transformers *ForCausalLM in place (see the module
    docstring); returns Q. lm_head becomes its own tensor (config.tie_word_embeddings False)."""
    config = model.config
    if config.model_type not in PRE_NORM_TYPES:
        raise UnsupportedModelError(f"--rotate supports pre-norm decoders ({', '.join(PRE_NORM_TYPES)}), not "
                                    f"{config.model_type!r}")
    q = rotation(config.hidden_size, kind, seed)
    body, head = model.model, model.lm_head
    if head.weight is body.embed_tokens.weight or head.weight.data_ptr() == body.embed_tokens.weight.data_ptr():
        head.weight = torch.nn.Parameter(body.embed_tokens.weight.detach().clone())
    config.tie_word_embeddings = False
    if getattr(config, "get_text_config", None) is not None:
        config.get_text_config().tie_word_embeddings = False

    def read(linear: torch.nn.Linear, g: torch.Tensor) -> None:
        _set(linear.weight, (linear.weight.double() * g) @ q)

    emb = body.embed_tokens.weight
    _set(emb, emb.double() @ q)
    for layer in body.layers:
        modules = dict(layer.named_modules())
        for norm, readers in READERS.items():
            g = modules[norm].weight.double()
            for name in readers:
                read(modules[name], g)
            modules[norm].weight.fill_(1.0)
        for name in WRITERS:
            w = modules[name]
            _set(w.weight, q.T @ w.weight.double())
            if w.bias is not None:
                _set(w.bias, w.bias.double() @ q)
    read(head, body.norm.weight.double())
    body.norm.weight.fill_(1.0)
    return q
