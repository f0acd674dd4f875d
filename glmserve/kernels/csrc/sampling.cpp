// Sampling's reductions over the vocabulary (CPU), for glmserve/engine/sampler.py.
//
//   first_max(x [S, V] f32, contiguous rows) -> [S] int64: each row's index of its maximum, the first of equal
//                maxima, and the first NaN where a row holds one: the index torch.max(x, dim=-1) returns. torch's
//                max over the last dim runs one scalar comparison chain per row (0.7-2 ms for 32 rows of 49,152 on one
//                core, up to 3.5% of a batch-32 decode step: bench/RESULTS.md); here each row is one vectorized pass over chunks of 1,024 (the
//                chunk's max and whether it holds a NaN: loops the compiler vectorizes in every variant), keeping
//                the first chunk that reaches the running maximum, then one scan of that chunk for the index.
//                Rows are split over torch's intra-op threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>
#include <limits>

namespace {

constexpr int64_t kChunk = 1024;

// The first index of the row's maximum (or of its first NaN) among n floats.
int64_t row_first_max(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_start = 0;
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t len = n - start < kChunk ? n - start : kChunk;
    const float* c = x + start;
    float m = -std::numeric_limits<float>::infinity();
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t j = 0; j < len; ++j) {
      m = c[j] > m ? c[j] : m;
      nan |= c[j] != c[j];
    }
    if (nan) {  // torch.max: a NaN is the maximum, the first one wins
      for (int64_t j = 0; j < len; ++j)
        if (c[j] != c[j]) return start + j;
    }
    if (m > best) {  // strictly: an equal maximum in a later chunk does not move the answer
      best = m;
      best_start = start;
    }
  }
  const int64_t len = n - best_start < kChunk ? n - best_start : kChunk;
  for (int64_t j = 0; j < len; ++j)
    if (x[best_start + j] == best) return best_start + j;
  return best_start;  // a row of -inf only: its first index, as torch.max
}

at::Tensor first_max(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "first_max: x must be a CPU tensor");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "first_max: x must be a float32 [S, V] tensor with contiguous, non-empty rows");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) op[i] = row_first_max(xp + i * stride, n);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("first_max", &first_max, "each row's first index of its maximum (torch.max(x, -1).indices), CPU float32");
}
