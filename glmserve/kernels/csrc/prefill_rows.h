// The contract shared by the prefill attention kernels (prefill_attention.cpp: bf16 on AVX-512; prefill_attention_f32.cpp:
// float32 on AVX2): q [T, Hq, D] holds rows b = 0..B-1 of q_lens[b] queries each, one after the other; row b's keys
// are the first kv_lens[b] of k [B, L, Hk, D] and v (as k), and its query i sits at position kv_lens[b] - q_lens[b] + i
// and attends keys at positions <= its own (a fresh prompt: B = 1, kv_lens = q_lens = T; a chunk over cached context:
// kv_lens = cached + chunk). Query head j reads KV head j / (Hq / Hk). Or, with slots [B, L] int64, k and v are a
// KV pool [Hk, num_slots, D] read in place: row b's key t is k[h, slots[b, t]] (no gathered copy of a cached context).
// Here: the argument checks, where each row's keys are (KeyRows), where each row starts in q and in a buffer of its keys
// packed in blocks, and the order of the work items over the threads.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace glmserve {

// Where the rows' keys (or values) are: the element offset of row b's key t of KV head h in k [B, L, Hk, D], or with
// slots in the pool k [Hk, num_slots, D]; B rows of up to L keys, Hk KV heads of D elements
struct KeyRows {
  int64_t B, L, Hk, D;
  int64_t stride_b = 0, stride_t, stride_h;
  const int64_t* slots = nullptr;  // [B, L] (contiguous), or none

  KeyRows(const at::Tensor& x, const std::optional<at::Tensor>& slot_ids) {
    if (slot_ids) {
      slots = slot_ids->data_ptr<int64_t>();
      B = slot_ids->size(0), L = slot_ids->size(1), Hk = x.size(0), D = x.size(2);
      stride_h = x.stride(0), stride_t = x.stride(1);
    } else {
      B = x.size(0), L = x.size(1), Hk = x.size(2), D = x.size(3);
      stride_b = x.stride(0), stride_t = x.stride(1), stride_h = x.stride(2);
    }
  }
  int64_t offset(int64_t b, int64_t t, int64_t h) const {
    return slots != nullptr ? h * stride_h + slots[b * L + t] * stride_t : b * stride_b + t * stride_t + h * stride_h;
  }
};

// Checks q, k, v, the lengths and the slots against the contract (the head dim, which each kernel limits, aside);
// `name` (the op) starts every message
inline void check_prefill_rows(const char* name, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& q_lens, const at::Tensor& kv_lens,
                               const std::optional<at::Tensor>& slots) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), name, ": CPU tensors");
  const auto floats = [](const at::Tensor& t) {
    return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat;
  };
  TORCH_CHECK(floats(q) && floats(k) && v.scalar_type() == k.scalar_type(), name,
              ": q, k, v must be bfloat16 or float32 (k and v of one dtype)");
  if (slots) {
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), name,
                ": with slots, q [T, Hq, D], k and v pools [Hk, num_slots, D] of one shape");
    TORCH_CHECK(slots->device().is_cpu() && slots->scalar_type() == at::kLong && slots->dim() == 2 &&
                    slots->is_contiguous(),
                name, ": slots are a contiguous CPU int64 [B, L]");
  } else {
    TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.sizes() == k.sizes(), name,
                ": q [T, Hq, D], k and v [B, L, Hk, D] of one shape");
  }
  const KeyRows rows(k, slots);
  TORCH_CHECK(q.size(1) % rows.Hk == 0, name, ": ", q.size(1), " query heads are not a multiple of ", rows.Hk,
              " KV heads");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(k.dim() - 1) == 1 && v.stride(v.dim() - 1) == 1, name,
              ": the head dim of q, k, v must be contiguous");
  for (const auto* t : {&q_lens, &kv_lens})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) == rows.B,
                name, ": q_lens and kv_lens are CPU int64 [B] with B = k.size(0) (slots.size(0) with slots)");
  const int64_t* ql = q_lens.data_ptr<int64_t>();
  const int64_t* kl = kv_lens.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t b = 0; b < rows.B; ++b) {
    TORCH_CHECK(ql[b] >= 0 && ql[b] <= kl[b] && kl[b] <= rows.L, name, ": row ", b, " has ", ql[b],
                " queries and ", kl[b], " keys of ", rows.L, " (need 0 <= queries <= keys <= L)");
    total += ql[b];
    if (slots) {
      const int64_t* row = rows.slots + b * rows.L;
      for (int64_t t = 0; t < kl[b]; ++t)
        TORCH_CHECK(row[t] >= 0 && row[t] < k.size(1), name, ": row ", b, " key ", t, " at slot ", row[t],
                    " outside the pool's ", k.size(1));
    }
  }
  TORCH_CHECK(total == q.size(0), name, ": q_lens sum to ", total, ", q has ", q.size(0), " tokens");
}

// Where each row starts: its first query in q (q_start) and its keys in a buffer that packs every (row, KV head)'s keys
// in blocks of `key_block`, the row's blocks after the previous rows' (pad_start, in keys: row b's region for KV head h
// starts at key pad_start[b] * Hk + h * padded(b)); keys: the buffer's keys per KV head
struct PackedRows {
  std::vector<int64_t> q_start, pad_start;
  int64_t keys = 0, key_block;
  const int64_t* kv_len;

  PackedRows(const int64_t* ql, const int64_t* kl, int64_t B, int64_t key_block)
      : q_start(B), pad_start(B), key_block(key_block), kv_len(kl) {
    int64_t tokens = 0;
    for (int64_t b = 0; b < B; ++b) {
      q_start[b] = tokens, pad_start[b] = keys;
      tokens += ql[b], keys += padded(b);
    }
  }
  int64_t padded(int64_t b) const { return (kv_len[b] + key_block - 1) / key_block * key_block; }
  // the first element of row b's region for KV head h in a buffer of Hk x keys rows of D elements
  int64_t region(int64_t b, int64_t h, int64_t Hk, int64_t D) const { return (pad_start[b] * Hk + h * padded(b)) * D; }

  // pack(b, h, blk): packs key block blk of row b, KV head h; every block of the buffer once, over the threads
  template <class Pack>
  void pack_blocks(int64_t Hk, const Pack& pack) const {
    at::parallel_for(0, keys / key_block * Hk, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {  // i: block i / Hk of the buffer, KV head i % Hk
        const int64_t at_key = i / Hk * key_block;
        const int64_t b = std::upper_bound(pad_start.begin(), pad_start.end(), at_key) - pad_start.begin() - 1;
        pack(b, i % Hk, (at_key - pad_start[b]) / key_block);
      }
    });
  }
};

// One work item: `item_queries` queries (block `block`) of row b with the query heads of KV head h; cost: the key
// blocks it visits (causal: up to its last query's position)
struct PrefillItem {
  int64_t b, h, block, cost;
};

// Every row's items, heaviest, lightest, second heaviest, second lightest, ...: at::parallel_for's contiguous ranges
// then carry similar work
inline std::vector<PrefillItem> balanced_items(const int64_t* ql, const int64_t* kl, int64_t B, int64_t Hk,
                                               int64_t item_queries, int64_t key_block) {
  std::vector<PrefillItem> items;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hk; ++h)
      for (int64_t blk = 0; blk * item_queries < ql[b]; ++blk) {
        const int64_t last = kl[b] - ql[b] + std::min(ql[b], (blk + 1) * item_queries) - 1;
        items.push_back({b, h, blk, last / key_block + 1});
      }
  std::sort(items.begin(), items.end(), [](const PrefillItem& x, const PrefillItem& y) { return x.cost > y.cost; });
  std::vector<PrefillItem> order;
  order.reserve(items.size());
  for (size_t lo = 0, hi = items.size(); lo < hi;) {
    order.push_back(items[lo++]);
    if (lo < hi) order.push_back(items[--hi]);
  }
  return order;
}

}  // namespace glmserve
