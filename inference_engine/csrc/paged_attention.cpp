// Attention on the CPU straight from the block-major paged KV cache, for every request of a
// step that is not a fresh prompt: decodes (one query token) and chunks that extend a cached
// context (a few query tokens after a prefix cache hit, a resumed or chunked prompt).
//
// Request r's query tokens are rows [query_starts[r], query_starts[r] + query_lens[r]) of the
// step's query; the last of them is position context_lens[r] - 1, and each sees the positions
// up to its own (causal). Their K and V are already in the cache. The work is split into items
// of one KV head and up to 16 query tokens of one request: for each, the scores of every
// (token, head sharing the KV head) row are computed in one pass over the keys, soft-maxed,
// and the values summed in a second pass. K and V are read in the cache's dtype and widened to
// float32 in registers; everything accumulates in float32. Items are spread over ATen's
// intra-op threads.
//
// Where the compiler targets AVX2 with FMA and head_dim is a multiple of 16, the work is done
// in 8-lane vectors: the scores of eight keys at a time (eight independent FMA chains, summed
// across lanes together), a vectorised exp, the next blocks prefetched (they lie anywhere in
// the cache), and the values summed into accumulators held in registers. Elsewhere a portable
// scalar loop computes the same thing.
//
// Built at engine start by ``inference_engine/cpu_kernels.py`` (torch.utils.cpp_extension)
// and registered as ``torch.ops.inference_engine.paged_attention``.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define IE_AVX2 1
#endif

namespace {

constexpr int64_t kTileTokens = 16;

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

// The step's tensors and their layout, as the items read them.
template <typename T>
struct Step {
  const T* query;
  T* out;
  int64_t query_token_stride, query_head_stride, out_token_stride, out_head_stride;
  const T* keys;
  const T* values;
  const int64_t* tables;
  const int64_t* context_lens;
  const int64_t* query_starts;
  const int64_t* query_lens;
  int64_t num_heads, head_dim, num_kv_heads, block_size, group, table_width;
  int64_t block_stride, head_stride;
  float scale;
};

// Query tokens [first, first + count) of one request, against one KV head: count * group rows,
// row k being token first + k / group and head kv_head * group + k % group.
struct Item {
  int64_t request, first, count, kv_head;
};

// What row k of an item sees: positions [0, limit), and where its query and output are.
template <typename T>
struct Row {
  int64_t limit;
  const T* query;
  T* out;
};

template <typename T>
Row<T> row_of(const Step<T>& step, const Item& item, int64_t k) {
  const int64_t r = item.request, token = item.first + k / step.group;
  const int64_t head = item.kv_head * step.group + k % step.group;
  const int64_t step_row = step.query_starts[r] + token;
  return {step.context_lens[r] - step.query_lens[r] + token + 1,
          step.query + step_row * step.query_token_stride + head * step.query_head_stride,
          step.out + step_row * step.out_token_stride + head * step.out_head_stride};
}

template <typename T>
void attend_scalar(const Step<T>& step, const Item& item, std::vector<float>& scores,
                   std::vector<float>& acc) {
  const int64_t head_dim = step.head_dim, block_size = step.block_size;
  const int64_t* table = step.tables + item.request * step.table_width;
  const int64_t head_offset = item.kv_head * step.head_stride;
  std::vector<float> q(head_dim);
  acc.resize(head_dim);
  for (int64_t k = 0; k < item.count * step.group; ++k) {
    const Row<T> row = row_of(step, item, k);
    for (int64_t d = 0; d < head_dim; ++d) q[d] = widen(row.query[d]) * step.scale;
    scores.resize(row.limit);
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t position = 0; position < row.limit; ++position) {
      const T* key = step.keys + table[position / block_size] * step.block_stride + head_offset +
                     (position % block_size) * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += q[d] * widen(key[d]);
      scores[position] = dot;
      peak = std::max(peak, dot);
    }
    float total = 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t position = 0; position < row.limit; ++position) {
      const float p = std::exp(scores[position] - peak);
      total += p;
      const T* value = step.values + table[position / block_size] * step.block_stride +
                       head_offset + (position % block_size) * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * widen(value[d]);
    }
    const float inverse = 1.f / total;
    for (int64_t d = 0; d < head_dim; ++d) row.out[d] = static_cast<T>(acc[d] * inverse);
  }
}

#ifdef IE_AVX2

// Sixteen values of a row as two float32 vectors. bf16 is widened by interleaving zero
// halves (one shuffle per eight values), which takes the values in the order ``order``;
// since a dot product does not care, q is laid out in the same order, and the value sums
// are put back in row order when written out.
template <typename C>
struct Lanes {
  static constexpr bool vectorised = false;
};

template <>
struct Lanes<float> {
  static constexpr bool vectorised = true;
  static constexpr int order[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  static inline void load(const float* p, __m256& low, __m256& high) {
    low = _mm256_loadu_ps(p);
    high = _mm256_loadu_ps(p + 8);
  }
};

template <>
struct Lanes<c10::BFloat16> {
  static constexpr bool vectorised = true;
  static constexpr int order[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
  static inline void load(const c10::BFloat16* p, __m256& low, __m256& high) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i zero = _mm256_setzero_si256();
    low = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));
    high = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));
  }
};

#ifdef __F16C__
template <>
struct Lanes<c10::Half> {
  static constexpr bool vectorised = true;
  static constexpr int order[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  static inline void load(const c10::Half* p, __m256& low, __m256& high) {
    low = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    high = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  }
};
#endif

// lane i of the result is the sum of the eight lanes of v[i]
inline __m256 sum_lanes(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 low = _mm256_hadd_ps(a, b), high = _mm256_hadd_ps(c, d);
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                       _mm256_permute2f128_ps(low, high, 0x31));
}

inline float max_lanes(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float add_lanes(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// e^x in float32 lanes: Cephes' expf (x = n ln2 + r, a degree-5 polynomial in r, times 2^n),
// within 2 ulp of std::exp over the range softmax uses (x <= 0); below -87 it is 0.
inline __m256 exp_lanes(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(exponent)));
}

// the cache lines of a block's keys or values for one head (the next block lies anywhere)
template <typename C>
inline void prefetch(const C* data, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(data);
  for (int64_t offset = 0; offset < count * static_cast<int64_t>(sizeof(C)); offset += 64) {
    _mm_prefetch(bytes + offset, _MM_HINT_T0);
  }
}

// out[0..16N) = sum over the context of probs[t] * V[t][0..16N), in ``Lanes<C>::order``
// within each sixteen; the 2N accumulators stay in registers
template <int N, typename C>
void sum_values(float* out, const float* probs, const C* v_data, const int64_t* table,
                int64_t length, int64_t block_size, int64_t block_stride, int64_t head_offset,
                int64_t head_dim) {
  __m256 acc[2 * N];
  for (int i = 0; i < 2 * N; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t start = 0; start < length; start += block_size) {
    const int64_t block = start / block_size;
    const C* values = v_data + table[block] * block_stride + head_offset;
    if (start + 2 * block_size < length) {
      prefetch(v_data + table[block + 2] * block_stride + head_offset, block_size * head_dim);
    }
    const int64_t count = std::min(block_size, length - start);
    for (int64_t t = 0; t < count; ++t) {
      const __m256 p = _mm256_set1_ps(probs[start + t]);
      const C* value = values + t * head_dim;
      for (int i = 0; i < N; ++i) {
        __m256 low, high;
        Lanes<C>::load(value + 16 * i, low, high);
        acc[2 * i] = _mm256_fmadd_ps(p, low, acc[2 * i]);
        acc[2 * i + 1] = _mm256_fmadd_ps(p, high, acc[2 * i + 1]);
      }
    }
  }
  for (int i = 0; i < 2 * N; ++i) _mm256_storeu_ps(out + 8 * i, acc[i]);
}

template <typename T>
void attend_vectorised(const Step<T>& step, const Item& item, std::vector<float>& scores,
                       std::vector<float>& q) {
  const int64_t head_dim = step.head_dim, block_size = step.block_size;
  const int64_t sixteens = head_dim / 16, rows = item.count * step.group;
  const int64_t* table = step.tables + item.request * step.table_width;
  const int64_t head_offset = item.kv_head * step.head_stride;
  const int* order = Lanes<T>::order;
  Row<T> row_list[kTileTokens * 16];
  Row<T>* row_of_k = rows <= kTileTokens * 16 ? row_list : nullptr;
  std::vector<Row<T>> many;
  if (row_of_k == nullptr) {
    many.resize(rows);
    row_of_k = many.data();
  }
  for (int64_t k = 0; k < rows; ++k) row_of_k[k] = row_of(step, item, k);
  // the last row sees the most: every key any row needs
  const int64_t length = row_of_k[rows - 1].limit, stride = (length + 7) / 8 * 8 + 8;
  q.resize(rows * head_dim);
  scores.resize(rows * stride);
  for (int64_t k = 0; k < rows; ++k) {
    for (int64_t d = 0; d < head_dim; ++d) {
      q[k * head_dim + d] = widen(row_of_k[k].query[d / 16 * 16 + order[d % 16]]) * step.scale;
    }
  }
  // scores = q K^T, block by block, eight keys at a time (a block's last keys repeated to
  // fill the eight: what they write past the block, the next block overwrites); a row skips
  // the keys past its own position
  for (int64_t start = 0; start < length; start += block_size) {
    const int64_t block = start / block_size;
    const T* base = step.keys + table[block] * step.block_stride + head_offset;
    if (start + 2 * block_size < length) {
      prefetch(step.keys + table[block + 2] * step.block_stride + head_offset, step.head_stride);
    }
    const int64_t count = std::min(block_size, length - start);
    for (int64_t t = 0; t < count; t += 8) {
      const T* keys[8];
      for (int64_t j = 0; j < 8; ++j) keys[j] = base + std::min(t + j, count - 1) * head_dim;
      for (int64_t k = 0; k < rows; ++k) {
        if (row_of_k[k].limit <= start + t) continue;
        const float* qk = q.data() + k * head_dim;
        __m256 dots[8];
        for (int j = 0; j < 8; ++j) dots[j] = _mm256_setzero_ps();
        for (int64_t i = 0; i < sixteens; ++i) {
          const __m256 q_low = _mm256_loadu_ps(qk + 16 * i);
          const __m256 q_high = _mm256_loadu_ps(qk + 16 * i + 8);
          for (int j = 0; j < 8; ++j) {
            __m256 low, high;
            Lanes<T>::load(keys[j] + 16 * i, low, high);
            dots[j] = _mm256_fmadd_ps(q_high, high, _mm256_fmadd_ps(q_low, low, dots[j]));
          }
        }
        _mm256_storeu_ps(scores.data() + k * stride + start + t, sum_lanes(dots));
      }
    }
  }
  float summed[256];
  std::vector<float> wide;
  float* into_row = summed;
  if (head_dim > 256) {
    wide.resize(head_dim);
    into_row = wide.data();
  }
  for (int64_t k = 0; k < rows; ++k) {
    const Row<T>& row = row_of_k[k];
    // softmax over this row's scores, left unnormalised until the end
    float* s = scores.data() + k * stride;
    const int64_t whole = row.limit / 8 * 8;
    __m256 peak_lanes = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < whole; t += 8) {
      peak_lanes = _mm256_max_ps(peak_lanes, _mm256_loadu_ps(s + t));
    }
    float peak = max_lanes(peak_lanes);
    for (int64_t t = whole; t < row.limit; ++t) peak = std::max(peak, s[t]);
    const __m256 peak_v = _mm256_set1_ps(peak);
    __m256 total_lanes = _mm256_setzero_ps();
    for (int64_t t = 0; t < whole; t += 8) {
      const __m256 e = exp_lanes(_mm256_sub_ps(_mm256_loadu_ps(s + t), peak_v));
      _mm256_storeu_ps(s + t, e);
      total_lanes = _mm256_add_ps(total_lanes, e);
    }
    float total = add_lanes(total_lanes);
    for (int64_t t = whole; t < row.limit; ++t) {
      s[t] = std::exp(s[t] - peak);
      total += s[t];
    }
    // the values weighed by the scores, up to 64 dims at a time
    for (int64_t first = 0; first < sixteens; first += 4) {
      const T* base = step.values + 16 * first;
      float* into = into_row + 16 * first;
      const int64_t n = std::min<int64_t>(4, sixteens - first);
      if (n == 4) {
        sum_values<4>(into, s, base, table, row.limit, block_size, step.block_stride,
                      head_offset, head_dim);
      } else if (n == 3) {
        sum_values<3>(into, s, base, table, row.limit, block_size, step.block_stride,
                      head_offset, head_dim);
      } else if (n == 2) {
        sum_values<2>(into, s, base, table, row.limit, block_size, step.block_stride,
                      head_offset, head_dim);
      } else {
        sum_values<1>(into, s, base, table, row.limit, block_size, step.block_stride,
                      head_offset, head_dim);
      }
    }
    const float inverse = 1.f / total;
    for (int64_t d = 0; d < head_dim; ++d) {
      row.out[d / 16 * 16 + order[d % 16]] = static_cast<T>(into_row[d] * inverse);
    }
  }
}

#endif  // IE_AVX2

template <typename T>
void attend(const Step<T>& step, int64_t num_requests) {
  std::vector<Item> tiles;
  for (int64_t r = 0; r < num_requests; ++r) {
    for (int64_t first = 0; first < step.query_lens[r]; first += kTileTokens) {
      tiles.push_back({r, first, std::min(kTileTokens, step.query_lens[r] - first), 0});
    }
  }
  bool vectorised = false;
#ifdef IE_AVX2
  if constexpr (Lanes<T>::vectorised) vectorised = step.head_dim % 16 == 0;
#endif
  const int64_t num_kv_heads = step.num_kv_heads;
  const int64_t num_items = static_cast<int64_t>(tiles.size()) * num_kv_heads;
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, scratch;
    for (int64_t index = begin; index < end; ++index) {
      Item item = tiles[index / num_kv_heads];
      item.kv_head = index % num_kv_heads;
#ifdef IE_AVX2
      if constexpr (Lanes<T>::vectorised) {
        if (vectorised) {
          attend_vectorised(step, item, scores, scratch);
          continue;
        }
      }
#endif
      attend_scalar(step, item, scores, scratch);
    }
  });
}

// Whether every request's rows, positions and blocks lie inside the step's query and the
// cache; where one does not, says which in ``refusal``. The message is formatted into a fixed
// buffer, not a std::string: the refusal is then thrown exactly as a literal message is, with
// no C++ stream code and no temporary to destroy in this library's frames while the exception
// passes (on the GPU machine's image, g++ 13.3 under gVisor, a check formatted with c10::str
// killed the process where the literal ones raised).
bool index_refusal(const at::Tensor& block_table, const at::Tensor& context_lens,
                   const at::Tensor& query_starts, const at::Tensor& query_lens,
                   int64_t num_blocks, int64_t block_size, int64_t num_tokens, char* refusal,
                   size_t size) {
  const int64_t num_requests = block_table.size(0), table_width = block_table.size(1);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* counts = query_lens.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const long long capacity = table_width * block_size;
  for (int64_t r = 0; r < num_requests; ++r) {
    if (!(counts[r] >= 1 && counts[r] <= lens[r] && lens[r] <= capacity)) {
      std::snprintf(refusal, size,
                    "request %lld: 1 <= query_lens (%lld) <= context_lens (%lld) <= %lld does "
                    "not hold",
                    static_cast<long long>(r), static_cast<long long>(counts[r]),
                    static_cast<long long>(lens[r]), capacity);
      return false;
    }
    if (!(starts[r] >= 0 && starts[r] + counts[r] <= num_tokens)) {
      std::snprintf(refusal, size, "request %lld: query rows [%lld, %lld) are outside [0, %lld)",
                    static_cast<long long>(r), static_cast<long long>(starts[r]),
                    static_cast<long long>(starts[r] + counts[r]),
                    static_cast<long long>(num_tokens));
      return false;
    }
    for (int64_t j = 0; j < (lens[r] + block_size - 1) / block_size; ++j) {
      const int64_t block = table[r * table_width + j];
      if (block < 0 || block >= num_blocks) {
        std::snprintf(refusal, size,
                      "block_table[%lld, %lld] = %lld is outside the cache's %lld blocks",
                      static_cast<long long>(r), static_cast<long long>(j),
                      static_cast<long long>(block), static_cast<long long>(num_blocks));
        return false;
      }
    }
  }
  return true;
}

void check_inputs(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_table,
                  const at::Tensor& context_lens, const at::Tensor& query_starts,
                  const at::Tensor& query_lens) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [T, H, D], cache [N, KVH, bs, D]");
  TORCH_CHECK(out.sizes() == query.sizes(), "out and query differ in shape");
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu() && out.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "K and V caches differ in shape");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type() &&
                  out.scalar_type() == key_cache.scalar_type(),
              "query, out and cache dtypes differ");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query and out rows are contiguous");
  TORCH_CHECK(query.size(2) == key_cache.size(3), "head_dim differs from the cache's");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "heads are not a multiple of KV heads");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches are contiguous");
  for (const at::Tensor* index : {&block_table, &context_lens, &query_starts, &query_lens}) {
    TORCH_CHECK(index->scalar_type() == at::kLong && index->is_contiguous() &&
                    index->device().is_cpu(),
                "block_table, context_lens, query_starts and query_lens are contiguous int64");
  }
  TORCH_CHECK(block_table.dim() == 2 && context_lens.dim() == 1 && query_starts.dim() == 1 &&
                  query_lens.dim() == 1,
              "block_table [R, max_blocks], context_lens, query_starts and query_lens [R]");
  const int64_t num_requests = block_table.size(0);
  TORCH_CHECK(context_lens.size(0) == num_requests && query_starts.size(0) == num_requests &&
                  query_lens.size(0) == num_requests,
              "one block table row, context length, query start and query length per request");
  // a position or a block outside the cache would read another request's memory, or none
  char refusal[256];
  TORCH_CHECK(index_refusal(block_table, context_lens, query_starts, query_lens, key_cache.size(0),
                            key_cache.size(2), query.size(0), refusal, sizeof(refusal)),
              static_cast<const char*>(refusal));
}

template <typename T>
Step<T> step_of(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                const at::Tensor& value_cache, const at::Tensor& block_table,
                const at::Tensor& context_lens, const at::Tensor& query_starts,
                const at::Tensor& query_lens, double scale) {
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  const int64_t head_dim = query.size(2);
  return {query.data_ptr<T>(),
          out.data_ptr<T>(),
          query.stride(0),
          query.stride(1),
          out.stride(0),
          out.stride(1),
          key_cache.data_ptr<T>(),
          value_cache.data_ptr<T>(),
          block_table.data_ptr<int64_t>(),
          context_lens.data_ptr<int64_t>(),
          query_starts.data_ptr<int64_t>(),
          query_lens.data_ptr<int64_t>(),
          query.size(1),
          head_dim,
          num_kv_heads,
          block_size,
          query.size(1) / num_kv_heads,
          block_table.size(1),
          num_kv_heads * block_size * head_dim,
          block_size * head_dim,
          static_cast<float>(scale)};
}

void paged_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_table,
                     const at::Tensor& context_lens, const at::Tensor& query_starts,
                     const at::Tensor& query_lens, double scale) {
  check_inputs(out, query, key_cache, value_cache, block_table, context_lens, query_starts,
               query_lens);
  const int64_t num_requests = block_table.size(0);
  switch (query.scalar_type()) {
    case at::kFloat:
      attend(step_of<float>(out, query, key_cache, value_cache, block_table, context_lens,
                            query_starts, query_lens, scale),
             num_requests);
      break;
    case at::kBFloat16:
      attend(step_of<c10::BFloat16>(out, query, key_cache, value_cache, block_table,
                                    context_lens, query_starts, query_lens, scale),
             num_requests);
      break;
    case at::kHalf:
      attend(step_of<c10::Half>(out, query, key_cache, value_cache, block_table, context_lens,
                                query_starts, query_lens, scale),
             num_requests);
      break;
    default:
      TORCH_CHECK(false, "paged_attention supports float32, bfloat16 and float16");
  }
}

}  // namespace

TORCH_LIBRARY(inference_engine, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_table, Tensor context_lens, Tensor query_starts, Tensor query_lens, "
      "float scale) -> ()");
}

TORCH_LIBRARY_IMPL(inference_engine, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
