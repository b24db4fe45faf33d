// Decode attention on the CPU straight from the block-major paged KV cache.
//
// One query token per request, attended over its own blocks through its block table: for
// each (request, KV head) the scores of the heads that share the KV head are computed in one
// pass over its keys, soft-maxed, and the values summed in a second pass. K and V are read
// once, in the cache's dtype, and widened to float32 in registers; everything accumulates in
// float32. Requests and KV heads are spread over ATen's intra-op threads.
//
// Built at engine start by ``inference_engine/cpu_kernels.py`` (torch.utils.cpp_extension)
// and registered as ``torch.ops.inference_engine.paged_decode_attention``.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float widen(T value) {
  return static_cast<float>(value);
}

template <>
inline float widen<c10::BFloat16>(c10::BFloat16 value) {
  // a bf16 is the high half of a float32
  uint32_t bits = static_cast<uint32_t>(value.x) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

template <typename Q, typename C>
void decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
            const at::Tensor& value_cache, const at::Tensor& block_table,
            const at::Tensor& context_lens, double scale) {
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t table_width = block_table.size(1);
  const int64_t block_stride = num_kv_heads * block_size * head_dim;
  const int64_t head_stride = block_size * head_dim;

  const Q* q_data = query.data_ptr<Q>();
  Q* out_data = out.data_ptr<Q>();
  const C* k_data = key_cache.data_ptr<C>();
  const C* v_data = value_cache.data_ptr<C>();
  const int64_t* tables = block_table.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const float scale_f = static_cast<float>(scale);

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t length = lens[b];
      const int64_t* table = tables + b * table_width;
      scores.resize(group * length);
      for (int64_t g = 0; g < group; ++g) {
        const Q* row = q_data + (b * num_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] = widen(row[d]) * scale_f;
      }
      // scores = q K^T, block by block
      for (int64_t start = 0; start < length; start += block_size) {
        const C* keys = k_data + table[start / block_size] * block_stride + kv_head * head_stride;
        const int64_t count = std::min(block_size, length - start);
        for (int64_t t = 0; t < count; ++t) {
          const C* key = keys + t * head_dim;
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = q.data() + g * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * widen(key[d]);
            scores[g * length + start + t] = dot;
          }
        }
      }
      // softmax over each head's scores
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * length;
        float peak = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < length; ++t) peak = std::max(peak, s[t]);
        float total = 0.f;
        for (int64_t t = 0; t < length; ++t) {
          s[t] = std::exp(s[t] - peak);
          total += s[t];
        }
        const float inverse = 1.f / total;
        for (int64_t t = 0; t < length; ++t) s[t] *= inverse;
      }
      // out = probs V, block by block
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < length; start += block_size) {
        const C* values = v_data + table[start / block_size] * block_stride + kv_head * head_stride;
        const int64_t count = std::min(block_size, length - start);
        for (int64_t t = 0; t < count; ++t) {
          const C* value = values + t * head_dim;
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * length + start + t];
            float* a = acc.data() + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * widen(value[d]);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        Q* row = out_data + (b * num_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<Q>(acc[g * head_dim + d]);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [B, H, D], cache [N, KVH, bs, D]");
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "K and V caches differ in shape");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "K and V caches differ");
  TORCH_CHECK(query.size(2) == key_cache.size(3), "head_dim differs from the cache's");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "heads are not a multiple of KV heads");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_table and context_lens are int64");
  TORCH_CHECK(block_table.size(0) == query.size(0) && context_lens.size(0) == query.size(0),
              "one block table row and one context length per query");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches are contiguous");
  const at::Tensor q = query.contiguous();
  const at::Tensor table = block_table.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  at::Tensor out = at::empty_like(q);
  const auto q_type = q.scalar_type(), c_type = key_cache.scalar_type();
  TORCH_CHECK(q_type == c_type, "query and cache dtypes differ");
  if (q_type == at::kFloat) {
    decode<float, float>(out, q, key_cache, value_cache, table, lens, scale);
  } else if (q_type == at::kBFloat16) {
    decode<c10::BFloat16, c10::BFloat16>(out, q, key_cache, value_cache, table, lens, scale);
  } else if (q_type == at::kHalf) {
    decode<c10::Half, c10::Half>(out, q, key_cache, value_cache, table, lens, scale);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32, bfloat16 and float16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(inference_engine, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_table, Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(inference_engine, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
