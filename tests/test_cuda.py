"""The engine on CUDA: every architecture against transformers' reference (float32 tightly, bfloat16
loosely), GLM-5 DSA, seeded sampling and the CUDA defaults. Skips cleanly where there is no GPU."""

from __future__ import annotations

import pytest
import torch
from parity import check_two_waves
from test_glm_moe_dsa import CONFIGS as DSA_CONFIGS
from test_glm_moe_dsa import make_model as make_dsa_model
from tiny_models import CONFIGS
from transformers import AutoModelForCausalLM

from glmserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ENGINE = dict(device="cuda", block_size=4, max_num_batched_tokens=24, max_num_seqs=8, kv_cache_memory_bytes=4 << 20)
TOLERANCE = {"float32": 5e-4, "bfloat16": 0.15}


def _reference(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_dense_architectures_match_transformers(arch, dtype, tiny_model_dir):
    path = tiny_model_dir(arch)
    llm = LLM(model=str(path), dtype=dtype, **ENGINE)
    check_two_waves(llm, _reference(path), (5, 17, 40), tol=TOLERANCE[dtype])


@pytest.mark.parametrize("arch", list(DSA_CONFIGS))
def test_sparse_mla_architectures_match_transformers(arch, tmp_path):
    path = make_dsa_model(arch, tmp_path)
    llm = LLM(model=str(path), dtype="float32", **ENGINE)
    check_two_waves(llm, _reference(path), (5, 17, 41, 60), tol=TOLERANCE["float32"])


def test_cuda_defaults_and_seeded_sampling(tiny_model_dir, engine_device):
    llm = LLM(model=str(tiny_model_dir("llama")), device="cuda", kv_cache_memory_bytes=4 << 20)
    if engine_device == "cpu":  # not forced to float32 by GLMSERVE_TEST_DEVICE: the CUDA default dtype
        assert llm.engine.dtype == torch.bfloat16
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True, n=2)
    first, second = (llm.generate([list(range(3, 20))], params)[0] for _ in range(2))
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert first.outputs[0].token_ids != first.outputs[1].token_ids
