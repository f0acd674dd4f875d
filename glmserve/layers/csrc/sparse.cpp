// Sparse decode attention's CPU kernels: the block indexer's bounds update and scores
// (glmserve/sparse/block.py), and the selection of each row's slots (glmserve/sparse/selection.py).
//
// bounds_update: for each written token in order, its block restarts from the key when the token sits at
// offset 0 of the block (a fresh or reused block is always written from there), else the block's min/max
// take the key in. Tokens of one block arrive in ascending offsets within a step (a sequence's chunk is
// contiguous), so one sequential pass is exact; a few microseconds per decode token and layer.
//
// block_scores:
// For each decode row b and each of its logical blocks w (physical block tables[b, w]), the sum over the
// query heads of the upper bound of each head's scaled logit on a key of that block:
//   sum over heads h of  scale * sum_d max(q[b,h,d] * lo[blk,kv(h),d], q[b,h,d] * hi[blk,kv(h),d])
// = scale * sum_h (relu(q_h) . hi + min(q_h, 0) . lo)   (Tang et al., 2024, "Quest", arXiv:2406.10774).
// Bounds are read in place ([num_blocks, 2, Hkv, D], float32 or bfloat16), one contiguous row per
// block, so the cost is one pass over the row's bounds (1/block_size of its keys and values); no
// gather copy and no skinny GEMM. Work is split over (row, block range) with at::parallel_for.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(double x) { return static_cast<float>(x); }

template <typename bound_t>
void scores_kernel(const float* q, const bound_t* bounds, const int64_t* tables, const int64_t* num_units,
                   float* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t W, float scale) {
  const int64_t group = H / Hkv;
  // the sum over heads is linear in the bounds: per row and kv head, sum the positive parts of its query
  // heads (they meet the max bound) and the negative parts (they meet the min bound) once
  std::vector<float> pos(B * Hkv * D, 0.f), neg(B * Hkv * D, 0.f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) {
        const float x = q[(b * H + h) * D + d];
        float* p = pos.data() + (b * Hkv + h / group) * D + d;
        float* n = neg.data() + (b * Hkv + h / group) * D + d;
        *p += std::max(x, 0.f);
        *n += std::min(x, 0.f);
      }
  at::parallel_for(0, B * W, 64, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / W, w = task % W;
      if (w >= num_units[b]) {
        out[task] = -std::numeric_limits<float>::infinity();
        continue;
      }
      const bound_t* lo = bounds + tables[task] * 2 * Hkv * D;  // [Hkv, D] min, then [Hkv, D] max
      const bound_t* hi = lo + Hkv * D;
      const float* qp = pos.data() + b * Hkv * D;
      const float* qn = neg.data() + b * Hkv * D;
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t i = 0; i < Hkv * D; ++i) total += qp[i] * to_float(hi[i]) + qn[i] * to_float(lo[i]);
      out[task] = total * scale;
    }
  });
}

template <typename bound_t>
void update_kernel(const int64_t* slots, const float* keys, bound_t* bounds, int64_t T, int64_t HD, int64_t block_size) {
  for (int64_t t = 0; t < T; ++t) {
    bound_t* lo = bounds + (slots[t] / block_size) * 2 * HD;
    bound_t* hi = lo + HD;
    const float* k = keys + t * HD;
    if (slots[t] % block_size == 0) {
      for (int64_t i = 0; i < HD; ++i) lo[i] = hi[i] = static_cast<bound_t>(k[i]);
    } else {
      for (int64_t i = 0; i < HD; ++i) {
        const bound_t v = static_cast<bound_t>(k[i]);
        if (to_float(v) < to_float(lo[i])) lo[i] = v;
        if (to_float(v) > to_float(hi[i])) hi[i] = v;
      }
    }
  }
}

// The selection rule of glmserve/sparse/settings.py for one row; kept positions, ascending.
void select_row(const float* scores, int64_t U, int64_t n, int64_t top_k, float threshold, int64_t sink,
                int64_t local, std::vector<int64_t>& out) {
  out.clear();
  const bool whole = threshold < 0 && (top_k < 0 || n <= top_k);
  if (whole) {
    for (int64_t j = 0; j < n; ++j) out.push_back(j);
    return;
  }
  const int64_t local_start = n - local;  // positions >= local_start are the local window
  const int64_t units = (n + U - 1) / U;
  std::vector<std::pair<float, int64_t>> cand;  // (score, unit) of units not wholly kept anyway
  for (int64_t u = 0; u < units; ++u) {
    const int64_t start = u * U, end = std::min(start + U, n);
    if (!(end <= sink || start >= local_start)) cand.emplace_back(scores[u], u);
  }
  if (threshold >= 0 && !cand.empty()) {  // min-max normalized score >= threshold (all equal: all 1)
    float lo = std::numeric_limits<float>::infinity(), hi = -lo;
    for (const auto& c : cand) lo = std::min(lo, c.first), hi = std::max(hi, c.first);
    const float span = hi - lo;
    std::vector<std::pair<float, int64_t>> kept;
    for (const auto& c : cand)
      if (!(span > 0) || (c.first - lo) / span >= threshold) kept.push_back(c);
    cand.swap(kept);
  }
  if (top_k >= 0) {  // the budget left after sinks and local window, in whole units: the best ones
    const int64_t budget = std::max<int64_t>(0, top_k - std::min(n, sink + local)) / U;
    if (static_cast<int64_t>(cand.size()) > budget) {
      std::nth_element(cand.begin(), cand.begin() + budget, cand.end(), [](const auto& a, const auto& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);  // ties: the earlier unit
      });
      cand.resize(budget);
    }
  }
  std::vector<char> chosen(units, 0);
  for (const auto& c : cand) chosen[c.second] = 1;
  for (int64_t j = 0; j < n; ++j)
    if (j < sink || j >= local_start || chosen[j / U]) out.push_back(j);
}

}  // namespace

std::vector<at::Tensor> select_slots(const at::Tensor& scores, int64_t unit_size, const at::Tensor& ctx_lens,
                                     const at::Tensor& top_k, const at::Tensor& threshold, const at::Tensor& sink,
                                     const at::Tensor& local, const at::Tensor& kv_slots) {
  TORCH_CHECK(scores.scalar_type() == at::kFloat && scores.is_contiguous() && scores.dim() == 2, "scores: [B, U] f32");
  TORCH_CHECK(kv_slots.scalar_type() == at::kLong && kv_slots.is_contiguous() && kv_slots.dim() == 2, "kv_slots");
  for (const auto* t : {&ctx_lens, &top_k, &sink, &local})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "per-row settings: [B] int64");
  TORCH_CHECK(threshold.scalar_type() == at::kFloat && threshold.is_contiguous(), "threshold: [B] float32");
  const int64_t B = scores.size(0), NU = scores.size(1), L = kv_slots.size(1);
  const int64_t* n = ctx_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(n[b] <= L && (n[b] + unit_size - 1) / unit_size <= NU, "context");
  std::vector<std::vector<int64_t>> rows(B);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      select_row(scores.data_ptr<float>() + b * NU, unit_size, n[b], top_k.data_ptr<int64_t>()[b],
                 threshold.data_ptr<float>()[b], sink.data_ptr<int64_t>()[b], local.data_ptr<int64_t>()[b], rows[b]);
  });
  int64_t width = 1;
  for (const auto& r : rows) width = std::max<int64_t>(width, r.size());
  auto slots = at::zeros({B, width}, kv_slots.options());
  auto lengths = at::empty({B}, ctx_lens.options());
  int64_t* out = slots.data_ptr<int64_t>();
  const int64_t* src = kv_slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    lengths.data_ptr<int64_t>()[b] = rows[b].size();
    for (size_t i = 0; i < rows[b].size(); ++i) out[b * width + i] = src[b * L + rows[b][i]];
  }
  return {slots, lengths};
}

void bounds_update(const at::Tensor& slots, const at::Tensor& keys, at::Tensor& bounds, int64_t block_size) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1, "slots: [T] int64");
  TORCH_CHECK(keys.scalar_type() == at::kFloat && keys.is_contiguous() && keys.dim() == 3, "keys: [T, Hkv, D] f32");
  TORCH_CHECK(bounds.dim() == 4 && bounds.size(1) == 2 && bounds.is_contiguous(), "bounds: [blocks, 2, Hkv, D]");
  const int64_t T = keys.size(0), HD = keys.size(1) * keys.size(2);
  TORCH_CHECK(slots.size(0) == T && bounds.size(2) * bounds.size(3) == HD, "shapes do not match");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, bounds.scalar_type(), "bounds_update", [&] {
    update_kernel<scalar_t>(slots.data_ptr<int64_t>(), keys.data_ptr<float>(), bounds.data_ptr<scalar_t>(), T, HD,
                            block_size);
  });
}

at::Tensor block_scores(const at::Tensor& q, const at::Tensor& bounds, const at::Tensor& tables,
                        const at::Tensor& num_units, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous [B, H, D] float32");
  TORCH_CHECK(bounds.dim() == 4 && bounds.size(1) == 2 && bounds.is_contiguous(), "bounds: [blocks, 2, Hkv, D]");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.dim() == 2, "tables: [B, W] int64");
  TORCH_CHECK(num_units.scalar_type() == at::kLong && num_units.is_contiguous(), "num_units: [B] int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = bounds.size(2), W = tables.size(1);
  TORCH_CHECK(bounds.size(3) == D && H % Hkv == 0 && tables.size(0) == B, "shapes do not match");
  auto out = at::empty({B, W}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, bounds.scalar_type(), "block_scores", [&] {
    scores_kernel<scalar_t>(q.data_ptr<float>(), bounds.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
                            num_units.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, Hkv, D, W,
                            static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bounds_update", &bounds_update, "fold written keys into the per-block key bounds (CPU)");
  m.def("block_scores", &block_scores, "Quest block scores (CPU)");
  m.def("select_slots", &select_slots, "each decode row's attended slots by the sparse selection rule (CPU)");
}
