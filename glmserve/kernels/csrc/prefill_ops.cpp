// Fused elementwise ops of a decoder layer (CPU), one pass over memory each where PyTorch takes several ops
// and temporaries: the residual add with the following RMSNorm, rope in place, and SwiGLU's silu(gate) * up.
// Plain loops written for the compiler to vectorize with each variant's flags (AVX-512, AVX2, scalar), the
// same source for all. They follow what vLLM's CPU ops do (csrc/cpu/layernorm.cpp fused_add_rms_norm,
// csrc/cpu/pos_encoding.cpp, csrc/cpu/activation.cpp silu_and_mul), written on our own.
//
//   add_rms_norm(x [T, H] f32 (updated in place), delta [T, H] f32 or bf16 (or empty: no add), weight [H] f32,
//                eps, bf16_out) -> [T, H] in bf16 or f32: x += delta, then rms_norm(x) * weight
//   rope_neox_(x [T, heads, D] f32 (inner dim contiguous, updated in place), cos [T, R], sin [T, R] f32) with
//                R <= D even, the tables as layers/rotary.py builds them (halves duplicated; sin's first half
//                negated): x[:R] = x[:R] * cos + roll(x[:R], R / 2) * sin
//   silu_and_mul(x [T, 2I] f32 or bf16) -> [T, I] the same dtype: silu(x[:, :I]) * x[:, I:], in float32,
//                rounded once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec_math.h"

namespace {

using glmserve::bf16_to_f32;
using glmserve::f32_to_bf16;
using glmserve::fast_exp;

void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor");
}

at::Tensor add_rms_norm(at::Tensor x, const at::Tensor& delta, const at::Tensor& weight, double eps, bool bf16_out) {
  check_cpu(x, "add_rms_norm: x");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "add_rms_norm: x must be a contiguous float32 [T, H] tensor");
  const int64_t t = x.size(0), h = x.size(1);
  const bool add = delta.numel() > 0;
  if (add) {
    TORCH_CHECK(delta.sizes() == x.sizes() && delta.is_contiguous() &&
                    (delta.scalar_type() == at::kFloat || delta.scalar_type() == at::kBFloat16),
                "add_rms_norm: delta must be a contiguous float32 or bf16 tensor of x's shape");
  }
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "add_rms_norm: weight must be a contiguous float32 [H] tensor");
  auto out = at::empty({t, h}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const bool delta_bf16 = add && delta.scalar_type() == at::kBFloat16;
  const float* df = add && !delta_bf16 ? delta.data_ptr<float>() : nullptr;
  const uint16_t* db = delta_bf16 ? reinterpret_cast<const uint16_t*>(delta.data_ptr<at::BFloat16>()) : nullptr;
  void* op = out.data_ptr();
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = xp + i * h;
      if (df) {
        const float* d = df + i * h;
        for (int64_t j = 0; j < h; ++j) row[j] += d[j];
      } else if (db) {
        const uint16_t* d = db + i * h;
        for (int64_t j = 0; j < h; ++j) row[j] += bf16_to_f32(d[j]);
      }
      float ss = 0.0f;
      for (int64_t j = 0; j < h; ++j) ss += row[j] * row[j];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + static_cast<float>(eps));
      if (bf16_out) {
        uint16_t* o = static_cast<uint16_t*>(op) + i * h;
        for (int64_t j = 0; j < h; ++j) o[j] = f32_to_bf16(row[j] * inv * wp[j]);
      } else {
        float* o = static_cast<float*>(op) + i * h;
        for (int64_t j = 0; j < h; ++j) o[j] = row[j] * inv * wp[j];
      }
    }
  });
  return out;
}

void rope_neox_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  check_cpu(x, "rope_neox_: x");
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1,
              "rope_neox_: x must be a float32 [T, heads, D] tensor with contiguous rows");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == t && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
              "rope_neox_: cos and sin must be contiguous float32 [T, R] tensors");
  const int64_t r = cos.size(1), half = r / 2;
  TORCH_CHECK(r % 2 == 0 && r <= d && r <= 1024, "rope_neox_: rotary width ", r, " must be even and at most D");
  float* xp = x.data_ptr<float>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    float lo[512];
    for (int64_t i = begin; i < end; ++i) {
      const float* c = cp + i * r;
      const float* s = sp + i * r;
      for (int64_t k = 0; k < heads; ++k) {
        float* v = xp + i * st + k * sh;
        for (int64_t j = 0; j < half; ++j) lo[j] = v[j];
        for (int64_t j = 0; j < half; ++j) v[j] = v[j] * c[j] + v[j + half] * s[j];
        for (int64_t j = 0; j < half; ++j) v[j + half] = v[j + half] * c[j + half] + lo[j] * s[j + half];
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_cpu(x, "silu_and_mul: x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "silu_and_mul: x must be a contiguous float32 or bf16 [T, 2I] tensor");
  const int64_t t = x.size(0), n = x.size(1) / 2;
  auto out = at::empty({t, n}, x.options());
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (bf16) {
        const uint16_t* g = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + i * 2 * n;
        uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + i * n;
        for (int64_t j = 0; j < n; ++j) {
          const float a = bf16_to_f32(g[j]);
          o[j] = f32_to_bf16(a / (1.0f + fast_exp(-a)) * bf16_to_f32(g[j + n]));
        }
      } else {
        const float* g = x.data_ptr<float>() + i * 2 * n;
        float* o = out.data_ptr<float>() + i * n;
        for (int64_t j = 0; j < n; ++j) o[j] = g[j] / (1.0f + fast_exp(-g[j])) * g[j + n];
      }
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "x += delta (in place), then RMSNorm(x) * weight in bf16 or f32 (CPU)");
  m.def("rope_neox_", &rope_neox_, "neox rotary embedding in place on float32 [T, heads, D] (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused [T, 2I] gate-up output (CPU)");
}
