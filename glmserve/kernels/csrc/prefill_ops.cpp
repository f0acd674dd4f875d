// Fused elementwise ops of a decoder layer (CPU), one pass over memory each where PyTorch takes several ops
// and temporaries: the residual add with the following RMSNorm, rope in place (or with the decode step's KV write),
// and SwiGLU's silu(gate) * up.
// Plain loops written for the compiler to vectorize with each variant's flags (AVX-512, AVX2, scalar), the
// same source for all. They follow what vLLM's CPU ops do (csrc/cpu/layernorm.cpp fused_add_rms_norm,
// csrc/cpu/pos_encoding.cpp, csrc/cpu/activation.cpp silu_and_mul), written on our own.
//
//   add_rms_norm(x [T, H] f32 (updated in place), delta [T, H] f32 or bf16 (or empty: no add), weight [H] f32,
//                eps, bf16_out) -> [T, H] in bf16 or f32: x += delta, then rms_norm(x) * weight
//   rope_neox_(x [T, heads, D] f32 or bf16 (inner dim contiguous, updated in place), cos [T, R], sin [T, R] f32)
//                with R <= D even, the tables as layers/rotary.py builds them (halves duplicated; sin's first half
//                negated): x[:R] = x[:R] * cos + roll(x[:R], R / 2) * sin, in float32 (bf16: rounded once)
//   silu_and_mul(x [T, 2I] f32 or bf16) -> [T, I] the same dtype: silu(x[:, :I]) * x[:, I:], in float32,
//                rounded once
//   rope_store_kv(qkv [T, (H + 2 Hkv) D] f32 contiguous, H, cos [T, R], sin [T, R] f32, k_cache, v_cache [Hkv, slots,
//                W] f32, bf16 (W = D) or int8 rows (W = D + 2, kv_int8.h) of one dtype, slots [T] int64) -> (q [T, H,
//                D], k [T, Hkv, D]) f32: a decode step's attention inputs in one pass (models/llama_decode.py): the q
//                and k heads rotated as rope_neox_ rotates them, k and v written into the caches at `slots` as
//                paged_decode.cpp's store_kv writes them (bf16: rounded to nearest even; int8: quantized per row),
//                q returned contiguous (paged_decode's input) and k as the cache holds it
//                (read back: what the sparse scorers are shown, glmserve/kv/kv_format.py `roundtrip`); qkv is not
//                changed
//
// Rows are split over torch's intra-op threads (at::parallel_for). The AVX-512 build runs each row 16 lanes at a
// time with masked tails (bf16 widened by a shift, narrowed to nearest even as torch rounds, SiLU's exp by
// vec_math.h's fast_exp2_16); the other builds run the same math as scalar loops for the compiler to vectorize.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec_math.h"  // before kv_int8.h: its abs_max
#include "kv_int8.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using glmserve::bf16_to_f32;
using glmserve::f32_to_bf16;

void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor");
}

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) { return bf16_to_f32(x); }
inline void put(float* p, float x) { *p = x; }
inline void put(uint16_t* p, float x) { *p = f32_to_bf16(x); }

#if defined(__AVX512F__)
inline __mmask16 lanes(int64_t n) {  // the first min(n, 16) lanes
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store16(float* p, __m512 x, __mmask16 m) { _mm512_mask_storeu_ps(p, m, x); }
inline void store16(uint16_t* p, __m512 x, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, glmserve::f32_to_bf16_16(x)); }
#endif

// One row of add_rms_norm: row += d (D_t float or bf16 bits; d null: no add), then o = row * rsqrt * w.
template <typename D_t, typename O_t>
void norm_row(float* row, const D_t* d, const float* w, O_t* o, int64_t h, float eps) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < h; j += 16) {
    const __mmask16 m = lanes(h - j);
    __m512 x = load16(row + j, m);
    if (d) {
      x = _mm512_add_ps(x, load16(d + j, m));
      store16(row + j, x, m);
    }
    acc = _mm512_fmadd_ps(x, x, acc);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(h) + eps));
  for (int64_t j = 0; j < h; j += 16) {
    const __mmask16 m = lanes(h - j);
    store16(o + j, _mm512_mul_ps(_mm512_mul_ps(load16(row + j, m), inv), load16(w + j, m)), m);
  }
#else
  if (d) {
    for (int64_t j = 0; j < h; ++j) row[j] += to_f32(d[j]);
  }
  float ss = 0.0f;
  for (int64_t j = 0; j < h; ++j) ss += row[j] * row[j];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
  for (int64_t j = 0; j < h; ++j) put(o + j, row[j] * inv * w[j]);
#endif
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
  float* of = bf16_out ? nullptr : out.data_ptr<float>();
  uint16_t* ob = bf16_out ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = xp + i * h;
      if (db) {
        ob ? norm_row(row, db + i * h, wp, ob + i * h, h, e) : norm_row(row, db + i * h, wp, of + i * h, h, e);
      } else {
        const float* d = df ? df + i * h : nullptr;
        ob ? norm_row(row, d, wp, ob + i * h, h, e) : norm_row(row, d, wp, of + i * h, h, e);
      }
    }
  });
  return out;
}

// One head of rope: v[:half], v[half:2 half] rotated by the row's tables c, s [2 half], in float32.
template <typename T>
void rope_head(T* v, const float* c, const float* s, int64_t half) {
#if defined(__AVX512F__)
  for (int64_t j = 0; j < half; j += 16) {
    const __mmask16 m = lanes(half - j);
    const __m512 a = load16(v + j, m), b = load16(v + half + j, m);
    store16(v + j, _mm512_fmadd_ps(a, load16(c + j, m), _mm512_mul_ps(b, load16(s + j, m))), m);
    store16(v + half + j, _mm512_fmadd_ps(b, load16(c + half + j, m), _mm512_mul_ps(a, load16(s + half + j, m))), m);
  }
#else
  for (int64_t j = 0; j < half; ++j) {
    const float a = to_f32(v[j]), b = to_f32(v[j + half]);
    put(v + j, a * c[j] + b * s[j]);
    put(v + j + half, b * c[j + half] + a * s[j + half]);
  }
#endif
}

template <typename T>
void rope_rows(T* xp, int64_t st, int64_t sh, int64_t t, int64_t heads, int64_t r, const float* cp, const float* sp) {
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t k = 0; k < heads; ++k) rope_head(xp + i * st + k * sh, cp + i * r, sp + i * r, r / 2);
  });
}

void rope_neox_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  check_cpu(x, "rope_neox_: x");
  TORCH_CHECK(x.dim() == 3 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.stride(2) == 1,
              "rope_neox_: x must be a float32 or bf16 [T, heads, D] tensor with contiguous rows");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == t && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
              "rope_neox_: cos and sin must be contiguous float32 [T, R] tensors");
  const int64_t r = cos.size(1);
  TORCH_CHECK(r % 2 == 0 && r <= d, "rope_neox_: rotary width ", r, " must be even and at most D");
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    rope_rows(x.data_ptr<float>(), x.stride(0), x.stride(1), t, heads, r, cp, sp);
  } else {
    rope_rows(reinterpret_cast<uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0), x.stride(1), t, heads, r, cp, sp);
  }
}

// One head's D values into a cache row: copied (float32), rounded to bf16, or quantized into an int8 row (kv_int8.h),
// with `back` (non-null) the stored values widened again
inline void store_head(const float* x, float* row, float*, int64_t d) { std::memcpy(row, x, d * sizeof(float)); }
inline void store_head(const float* x, uint16_t* row, float* back, int64_t d) {
  for (int64_t j = 0; j < d; ++j) {
    row[j] = f32_to_bf16(x[j]);
    if (back) back[j] = bf16_to_f32(row[j]);
  }
}
inline void store_head(const float* x, int8_t* row, float* back, int64_t d) {
  glmserve::quantize_int8_row(x, row, back, d);
}

template <typename C>
void rope_store_rows(const float* qkv, int64_t t, int64_t heads, int64_t kv_heads, int64_t d, int64_t r,
                     const float* cp, const float* sp, C* kc, C* vc, int64_t num_slots, const int64_t* slot, float* q,
                     float* k) {
  const int64_t width = (heads + 2 * kv_heads) * d;
  const int64_t row_width = std::is_same_v<C, int8_t> ? d + glmserve::kInt8ScaleBytes : d;  // a cache row
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* row = qkv + i * width;
      float* qi = q + i * heads * d;
      float* ki = k + i * kv_heads * d;
      std::memcpy(qi, row, heads * d * sizeof(float));
      std::memcpy(ki, row + heads * d, kv_heads * d * sizeof(float));
      for (int64_t h = 0; h < heads; ++h) rope_head(qi + h * d, cp + i * r, sp + i * r, r / 2);
      for (int64_t h = 0; h < kv_heads; ++h) {
        float* kh = ki + h * d;
        rope_head(kh, cp + i * r, sp + i * r, r / 2);
        const int64_t at = (h * num_slots + slot[i]) * row_width;
        store_head(kh, kc + at, kh, d);
        store_head(row + (heads + kv_heads + h) * d, vc + at, nullptr, d);
      }
    }
  });
}

std::vector<at::Tensor> rope_store_kv(const at::Tensor& qkv, int64_t heads, const at::Tensor& cos,
                                      const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                      const at::Tensor& slots) {
  check_cpu(qkv, "rope_store_kv: qkv");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16 ||
                   k_cache.scalar_type() == at::kChar),
              "rope_store_kv: caches must be contiguous float32, bf16 or int8 [Hkv, slots, W] tensors of one dtype");
  const bool int8_rows = k_cache.scalar_type() == at::kChar;
  const int64_t kv_heads = k_cache.size(0), num_slots = k_cache.size(1),
                d = k_cache.size(2) - (int8_rows ? glmserve::kInt8ScaleBytes : 0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous() && heads > 0 &&
                  qkv.size(1) == (heads + 2 * kv_heads) * d,
              "rope_store_kv: qkv must be a contiguous float32 [T, (H + 2 Hkv) D] tensor");
  const int64_t t = qkv.size(0);
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == t && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
              "rope_store_kv: cos and sin must be contiguous float32 [T, R] tensors");
  const int64_t r = cos.size(1);
  TORCH_CHECK(r % 2 == 0 && r <= d, "rope_store_kv: rotary width ", r, " must be even and at most D");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1 && slots.size(0) == t,
              "rope_store_kv: slots must be a contiguous int64 [T] tensor");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < num_slots, "rope_store_kv: slot ", slot[i], " outside the cache's ",
                num_slots);
  auto q = at::empty({t, heads, d}, qkv.options());
  auto k = at::empty({t, kv_heads, d}, qkv.options());
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>(), *xp = qkv.data_ptr<float>();
  if (k_cache.scalar_type() == at::kFloat) {
    rope_store_rows(xp, t, heads, kv_heads, d, r, cp, sp, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                    num_slots, slot, q.data_ptr<float>(), k.data_ptr<float>());
  } else if (int8_rows) {
    rope_store_rows(xp, t, heads, kv_heads, d, r, cp, sp, k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(),
                    num_slots, slot, q.data_ptr<float>(), k.data_ptr<float>());
  } else {
    rope_store_rows(xp, t, heads, kv_heads, d, r, cp, sp, reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
                    reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::BFloat16>()), num_slots, slot, q.data_ptr<float>(),
                    k.data_ptr<float>());
  }
  return {q, k};
}

// One row of silu_and_mul: o = silu(g[:n]) * g[n:2n], in float32 (vec_math.h's silu_mul: the fused gate-up linear
// of quant_matmul.cpp computes the same floats).
template <typename T>
void silu_row(const T* g, T* o, int64_t n) {
#if defined(__AVX512F__)
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = lanes(n - j);
    store16(o + j, glmserve::silu_mul_16(load16(g + j, m), load16(g + n + j, m)), m);
  }
#else
  for (int64_t j = 0; j < n; ++j) put(o + j, glmserve::silu_mul(to_f32(g[j]), to_f32(g[j + n])));
#endif
}

template <typename T>
void silu_rows(const T* x, T* out, int64_t t, int64_t n) {
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) silu_row(x + i * 2 * n, out + i * n, n);
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_cpu(x, "silu_and_mul: x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "silu_and_mul: x must be a contiguous float32 or bf16 [T, 2I] tensor");
  const int64_t t = x.size(0), n = x.size(1) / 2;
  auto out = at::empty({t, n}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    silu_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
              reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), t, n);
  } else {
    silu_rows(x.data_ptr<float>(), out.data_ptr<float>(), t, n);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "x += delta (in place), then RMSNorm(x) * weight in bf16 or f32 (CPU)");
  m.def("rope_neox_", &rope_neox_, "neox rotary embedding in place on float32 or bf16 [T, heads, D] (CPU)");
  m.def("rope_store_kv", &rope_store_kv, "a decode step's rope of q and k and KV write in one pass (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused [T, 2I] gate-up output (CPU)");
}
