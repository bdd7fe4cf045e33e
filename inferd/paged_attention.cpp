// Decode attention read straight from the pool's pages: one new token per sequence, attending over its
// context through its block table, with no gathered copy of K/V.
//
// Gathering each sequence's pages into a contiguous [keys, heads, dim] tensor and handing it to
// scaled_dot_product_attention reads the whole context twice and writes it once; this reads it once.
// Each work item is one sequence and one KV head: the query heads that share that KV head score every
// key (K is read once for all of them), take a softmax in float32, then sum V (read once) with those
// weights. Work items run on torch's intra-op threads.
//
// Built by inferd.paged_kernel with the machine's C++ compiler; loaded with torch.ops.load_library.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Rows are `Dim` long where the head size is one the compiler sees (0: any other, read at run time): a
// known length makes each row a few whole vectors, with no loop around them.
template <int Dim>
struct Row {
    const int64_t n;
    constexpr int64_t size() const { return Dim > 0 ? Dim : n; }
};

template <int Dim>
inline void to_float(Row<Dim> row, const float* src, float* dst) {
    std::memcpy(dst, src, row.size() * sizeof(float));
}

template <int Dim>
inline void to_float(Row<Dim> row, const c10::BFloat16* src, float* dst) {
    const auto* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
    for (int64_t i = 0; i < row.size(); ++i) {
        const uint32_t widened = static_cast<uint32_t>(bits[i]) << 16;
        std::memcpy(dst + i, &widened, sizeof(float));
    }
}

template <int Dim>
inline void to_float(Row<Dim> row, const c10::Half* src, float* dst) {
#ifdef __FLT16_MAX__
    const auto* halves = reinterpret_cast<const _Float16*>(src);
#pragma omp simd
    for (int64_t i = 0; i < row.size(); ++i) dst[i] = static_cast<float>(halves[i]);
#else
    for (int64_t i = 0; i < row.size(); ++i) dst[i] = static_cast<float>(src[i]);
#endif
}

// A head size the lanes divide sums into 16 partial sums, then halves them four times: a reduction clause
// left the compiler adding the lanes one by one, a chain of dependent scalar adds that took half the kernel's
// time at head size 32.
constexpr int kLanes = 16;

template <int Dim>
inline float dot(Row<Dim> row, const float* a, const float* b) {
    if constexpr (Dim > 0 && Dim % kLanes == 0) {
        float part[kLanes] = {};
        for (int64_t i = 0; i < Dim; i += kLanes) {
#pragma omp simd
            for (int j = 0; j < kLanes; ++j) part[j] += a[i + j] * b[i + j];
        }
        for (int width = kLanes / 2; width > 0; width /= 2) {
#pragma omp simd
            for (int j = 0; j < width; ++j) part[j] += part[j + width];
        }
        return part[0];
    } else {
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < row.size(); ++i) sum += a[i] * b[i];
        return sum;
    }
}

template <int Dim>
inline void add_scaled(Row<Dim> row, float* acc, const float* x, float weight) {
#pragma omp simd
    for (int64_t i = 0; i < row.size(); ++i) acc[i] += weight * x[i];
}

// A key or value row as float32: the row itself where the pages hold float32, else widened into `scratch`.
template <typename T, int Dim>
inline const float* row_as_float(Row<Dim> row, const T* src, float* scratch) {
    if constexpr (std::is_same_v<T, float>) {
        return src;
    } else {
        to_float(row, src, scratch);
        return scratch;
    }
}

// The next page's slot, asked for ahead: the pages of a sequence lie anywhere in the pool, so the
// hardware's prefetcher, which follows strides, starts over at each one.
inline void prefetch(const void* start, int64_t bytes) {
    const char* p = static_cast<const char*>(start);
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i);
}

// `visit(t, slot)` for each of a sequence's first `len` slots, page by page through its table; `base` is
// the pool at the K or V half of a page. While a page is read, the same `span` bytes of each slot of the
// next page (from `ahead` elements into the slot) are asked for.
template <typename T, typename Visit>
inline void for_each_slot(const T* base, const int64_t* table, int64_t len, int64_t block_size, int64_t s_block,
                          int64_t s_slot, int64_t ahead, int64_t span, Visit&& visit) {
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const T* page = base + table[t0 / block_size] * s_block;
        const T* next = t0 + block_size < len ? base + table[t0 / block_size + 1] * s_block : nullptr;
        for (int64_t t = t0; t < std::min(t0 + block_size, len); ++t) {
            if (next != nullptr) prefetch(next + (t - t0) * s_slot + ahead, span);
            visit(t, page + (t - t0) * s_slot);
        }
    }
}

// exp for the softmax, in a form the compiler vectorises (libm's expf is a call per element): 2^n * e^r,
// |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error under 2e-7, about libm's rounding).
inline float fast_exp(float x) {
    x = x < -87.f ? -87.f : x;                         // the scores are shifted by their max: x <= 0
    const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;     // rounded to the nearest integer
    const float r = x - n * 0.693145752f - n * 1.42860677e-6f;       // ln2 in two parts
    float p = 1.f / 720;
    p = p * r + 1.f / 120;
    p = p * r + 1.f / 24;
    p = p * r + 1.f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

inline void softmax(float* s, int64_t n) {
    float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
    for (int64_t t = 0; t < n; ++t) top = s[t] > top ? s[t] : top;
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < n; ++t) {
        s[t] = fast_exp(s[t] - top);
        total += s[t];
    }
    const float inv = 1.f / total;
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) s[t] *= inv;
}

template <typename T, int Dim>
void decode(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables, const at::Tensor& lens,
            double scale, at::Tensor& out) {
    const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
    const Row<Dim> row{dim};
    const int64_t kv_heads = cache.size(3), block_size = cache.size(2);
    const int64_t group = heads / kv_heads, max_blocks = tables.size(1);
    const int64_t q_row = q.stride(0), q_head = q.stride(1);
    const int64_t s_block = cache.stride(0), s_kv = cache.stride(1), s_slot = cache.stride(2),
                  s_head = cache.stride(3);
    const T* q_data = q.const_data_ptr<T>();
    const T* pages = cache.const_data_ptr<T>();
    const int64_t* table_data = tables.const_data_ptr<int64_t>();
    const int64_t* len_data = lens.const_data_ptr<int64_t>();
    T* out_data = out.mutable_data_ptr<T>();
    // A work item is one sequence, all its KV heads: each key slot's heads lie side by side, so the
    // item reads its pages front to back. With fewer sequences than threads, one KV head per item.
    const int64_t splits = batch >= at::get_num_threads() ? 1 : kv_heads, per_item = kv_heads / splits;

    at::parallel_for(0, batch * splits, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> queries(heads * dim), acc(heads * dim), scratch(dim), scores;
        for (int64_t item = begin; item < end; ++item) {
            const int64_t b = item / splits, g0 = item % splits * per_item, g1 = g0 + per_item;
            const int64_t len = len_data[b], h0 = g0 * group, h1 = g1 * group;
            const int64_t* table = table_data + b * max_blocks;
            const int64_t span = (g1 - g0 - 1) * s_head * sizeof(T) + dim * sizeof(T);   // bytes of a slot read
            for (int64_t h = h0; h < h1; ++h) {
                float* qh = queries.data() + h * dim;
                to_float(row, q_data + b * q_row + h * q_head, qh);
                for (int64_t i = 0; i < dim; ++i) qh[i] *= static_cast<float>(scale);
            }
            scores.resize(heads * len);
            for_each_slot(pages, table, len, block_size, s_block, s_slot, g0 * s_head, span,
                          [&](int64_t t, const T* slot) {        // every key, once, scored for its heads
                for (int64_t g = g0; g < g1; ++g) {
                    const float* key = row_as_float(row, slot + g * s_head, scratch.data());
                    for (int64_t h = g * group; h < (g + 1) * group; ++h)
                        scores[h * len + t] = dot(row, queries.data() + h * dim, key);
                }
            });
            for (int64_t h = h0; h < h1; ++h) softmax(scores.data() + h * len, len);
            std::fill(acc.begin() + h0 * dim, acc.begin() + h1 * dim, 0.f);
            for_each_slot(pages + s_kv, table, len, block_size, s_block, s_slot, g0 * s_head, span,
                          [&](int64_t t, const T* slot) {        // every value, once, weighted likewise
                for (int64_t g = g0; g < g1; ++g) {
                    const float* value = row_as_float(row, slot + g * s_head, scratch.data());
                    for (int64_t h = g * group; h < (g + 1) * group; ++h)
                        add_scaled(row, acc.data() + h * dim, value, scores[h * len + t]);
                }
            });
            T* o = out_data + b * heads * dim;
            for (int64_t i = h0 * dim; i < h1 * dim; ++i) o[i] = static_cast<T>(acc[i]);
        }
    });
}

template <typename T>
void decode_any_dim(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables, const at::Tensor& lens,
                    double scale, at::Tensor& out) {
    switch (q.size(2)) {                               // the head sizes of the models inferd serves
        case 32: return decode<T, 32>(q, cache, tables, lens, scale, out);
        case 64: return decode<T, 64>(q, cache, tables, lens, scale, out);
        case 128: return decode<T, 128>(q, cache, tables, lens, scale, out);
        default: return decode<T, 0>(q, cache, tables, lens, scale, out);
    }
}

// q [B, heads, dim]; cache [blocks, 2 (K, V), block_size, kv_heads, dim], the last dim contiguous;
// tables [B, max_blocks] int64; lens [B] int64, each sequence's keys (its new token's included).
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                        const at::Tensor& lens, double scale) {
    TORCH_CHECK(q.dim() == 3 && cache.dim() == 5 && tables.dim() == 2 && lens.dim() == 1,
                "paged_decode: q [B, heads, dim], cache [blocks, 2, block_size, kv_heads, dim], tables [B, n], lens [B]");
    TORCH_CHECK(cache.size(1) == 2 && cache.size(4) == q.size(2), "paged_decode: cache and q disagree on dim");
    TORCH_CHECK(q.size(1) % cache.size(3) == 0, "paged_decode: heads must be a multiple of kv_heads");
    TORCH_CHECK(tables.size(0) == q.size(0) && lens.size(0) == q.size(0), "paged_decode: one table and length per row");
    TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "paged_decode: q and cache dtypes differ");
    TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong,
                "paged_decode: tables and lens are int64");
    TORCH_CHECK(q.stride(2) == 1 && cache.stride(4) == 1, "paged_decode: the dim axis must be contiguous");
    const at::Tensor t = tables.contiguous(), l = lens.contiguous();
    const int64_t blocks = cache.size(0), block_size = cache.size(2), width = t.size(1);
    const int64_t* table_data = t.const_data_ptr<int64_t>();
    const int64_t* len_data = l.const_data_ptr<int64_t>();
    for (int64_t b = 0; b < q.size(0); ++b) {          // a bad table must not read outside the pool
        TORCH_CHECK(len_data[b] >= 1 && len_data[b] <= width * block_size, "paged_decode: length ", len_data[b],
                    " outside the table's ", width * block_size, " slots");
        for (int64_t i = 0; i < (len_data[b] + block_size - 1) / block_size; ++i)
            TORCH_CHECK(table_data[b * width + i] >= 0 && table_data[b * width + i] < blocks,
                        "paged_decode: block ", table_data[b * width + i], " outside the pool's ", blocks);
    }
    at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
    switch (q.scalar_type()) {
        case at::kFloat: decode_any_dim<float>(q, cache, t, l, scale, out); break;
        case at::kBFloat16: decode_any_dim<c10::BFloat16>(q, cache, t, l, scale, out); break;
        case at::kHalf: decode_any_dim<c10::Half>(q, cache, t, l, scale, out); break;
        default: TORCH_CHECK(false, "paged_decode: float32, bfloat16 or float16 only, not ", q.scalar_type());
    }
    return out;
}

}  // namespace

TORCH_LIBRARY(kvpool, m) {
    m.def("paged_decode(Tensor q, Tensor cache, Tensor tables, Tensor lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvpool, CPU, m) { m.impl("paged_decode", &paged_decode); }
