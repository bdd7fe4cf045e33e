// Decode attention read straight from the pool's pages: one new token per sequence, attending over its
// context through its block table, with no gathered copy of K/V.
//
// Gathering each sequence's pages into a contiguous [keys, heads, dim] tensor and handing it to
// scaled_dot_product_attention reads the whole context twice and writes it once; this reads it once.
// The query heads that share a KV head score every key (K is read once for all of them), take a softmax
// in float32, then sum V (read once) with those weights. Work items run on torch's intra-op threads.
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

// Keys are taken in tiles of 16. Where the head size is a multiple of 16, a head's products with a tile's
// keys are sixteen 16-lane vectors, folded together into the tile's 16 scores (15 shuffles and adds in
// all, where summing each key's lanes alone takes 4 per key and left the K pass twice the V pass), and
// the tile's values are summed into accumulators held in registers, stored once per tile.
constexpr int kLanes = 16, kTile = kLanes;          // a tile's scores fill one vector
using Vec = float __attribute__((vector_size(64)));
using LooseVec = float __attribute__((vector_size(64), aligned(4)));      // a row need not be 64-byte aligned

inline Vec load(const float* p) { return *reinterpret_cast<const LooseVec*>(p); }
inline void store(float* p, Vec v) { *reinterpret_cast<LooseVec*>(p) = v; }

// clang's and GCC's names for picking lanes from two vectors (GCC knows clang's only from release 12).
#ifdef __clang__
#define KVPOOL_PICK(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
using Lanes = int32_t __attribute__((vector_size(64)));
#define KVPOOL_PICK(x, y, ...) __builtin_shuffle(x, y, Lanes{__VA_ARGS__})
#endif

// Two vectors whose lanes fall in groups of 2G, one group per key, into one whose groups of G hold the
// same keys in the same order, each group's lanes summed in pairs.
template <int G>
inline Vec fold(Vec x, Vec y) {
    if constexpr (G == 8) {
        return KVPOOL_PICK(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               KVPOOL_PICK(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    } else if constexpr (G == 4) {
        return KVPOOL_PICK(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               KVPOOL_PICK(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    } else if constexpr (G == 2) {
        return KVPOOL_PICK(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               KVPOOL_PICK(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    } else {
        return KVPOOL_PICK(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
               KVPOOL_PICK(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    }
}

// Lane t of the result: the sum of p[t]'s lanes.
inline Vec lane_sums(const Vec* p) {
    Vec a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i) a[i] = fold<8>(p[2 * i], p[2 * i + 1]);
    for (int i = 0; i < 4; ++i) b[i] = fold<4>(a[2 * i], a[2 * i + 1]);
    for (int i = 0; i < 2; ++i) c[i] = fold<2>(b[2 * i], b[2 * i + 1]);
    return fold<1>(c[0], c[1]);
}

// A query head's scores against the tile's n keys, into `scores[0, n)`.
template <int Dim>
inline void score_tile(Row<Dim> row, const float* query, const float* const* keys, int64_t n, float* scores) {
    if constexpr (Dim > 0 && Dim % kLanes == 0) {
        Vec q[Dim / kLanes], p[kTile];
        for (int c = 0; c < Dim / kLanes; ++c) q[c] = load(query + kLanes * c);
        for (int t = 0; t < kTile; ++t) {
            p[t] = Vec{};
            if (t < n)
                for (int c = 0; c < Dim / kLanes; ++c) p[t] += q[c] * load(keys[t] + kLanes * c);
        }
        const Vec s = lane_sums(p);
        if (n == kTile) {
            store(scores, s);
        } else {
            for (int t = 0; t < n; ++t) scores[t] = s[t];
        }
    } else {
        for (int64_t t = 0; t < n; ++t) {
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < row.size(); ++i) sum += query[i] * keys[t][i];
            scores[t] = sum;
        }
    }
}

// acc += the tile's n values weighted by `weights[0, n)`.
template <int Dim>
inline void accumulate_tile(Row<Dim> row, float* acc, const float* const* values, int64_t n, const float* weights) {
    if constexpr (Dim > 0 && Dim % kLanes == 0) {
        Vec a[Dim / kLanes];
        for (int c = 0; c < Dim / kLanes; ++c) a[c] = load(acc + kLanes * c);
        for (int64_t t = 0; t < n; ++t) {
            const float w = weights[t];
            for (int c = 0; c < Dim / kLanes; ++c) a[c] += w * load(values[t] + kLanes * c);
        }
        for (int c = 0; c < Dim / kLanes; ++c) store(acc + kLanes * c, a[c]);
    } else {
        for (int64_t t = 0; t < n; ++t) {
#pragma omp simd
            for (int64_t i = 0; i < row.size(); ++i) acc[i] += weights[t] * values[t][i];
        }
    }
}

// The slots of keys [t0, t0 + n) through the table, and the same slots of the next page (null past the
// sequence's last page); `base` is the pool at the K or V half of a page.
template <typename T>
inline void tile_slots(const T* base, const int64_t* table, int64_t t0, int64_t n, int64_t len, int64_t block_size,
                       int64_t s_block, int64_t s_slot, const T** slots, const T** ahead) {
    for (int64_t i = 0; i < n; ++i) {
        const int64_t page = (t0 + i) / block_size, offset = (t0 + i) % block_size;
        slots[i] = base + table[page] * s_block + offset * s_slot;
        ahead[i] = (page + 1) * block_size < len ? base + table[page + 1] * s_block + offset * s_slot : nullptr;
    }
}

// The pages of a sequence lie anywhere in the pool, so the hardware's prefetcher, which follows strides,
// starts over at each one: while one KV head's rows of a tile are read, its rows of the next page are asked
// for, a few lines at a time between the arithmetic rather than a page's worth at once. They are asked
// into L2, not L1: prefetches into L1 held the few L1 miss buffers the loads themselves needed, and a
// decode over pages in DRAM ran 1.5x slower for it.
template <typename T>
inline void prefetch_rows(const T* const* ahead, int64_t n, int64_t head_offset, int64_t bytes) {
    for (int64_t t = 0; t < n; ++t) {
        if (ahead[t] == nullptr) continue;
        const char* p = reinterpret_cast<const char*>(ahead[t] + head_offset);
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
    }
}

// One KV head's rows of a tile as float32: the rows themselves where the pages hold float32, else widened
// into `scratch`.
template <typename T, int Dim>
inline void tile_rows(Row<Dim> row, const T* const* slots, int64_t n, int64_t head_offset, float* scratch,
                      const float** rows) {
    for (int64_t t = 0; t < n; ++t) {
        if constexpr (std::is_same_v<T, float>) {
            rows[t] = slots[t] + head_offset;
        } else {
            to_float(row, slots[t] + head_offset, scratch + t * row.size());
            rows[t] = scratch + t * row.size();
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
        std::vector<float> queries(heads * dim), acc(heads * dim), scratch(kTile * dim), scores;
        const T *slots[kTile], *ahead[kTile];
        const float* rows[kTile];
        for (int64_t item = begin; item < end; ++item) {
            const int64_t b = item / splits, g0 = item % splits * per_item, g1 = g0 + per_item;
            const int64_t len = len_data[b], h0 = g0 * group, h1 = g1 * group;
            const int64_t* table = table_data + b * max_blocks;
            for (int64_t h = h0; h < h1; ++h) {
                float* qh = queries.data() + h * dim;
                to_float(row, q_data + b * q_row + h * q_head, qh);
                for (int64_t i = 0; i < dim; ++i) qh[i] *= static_cast<float>(scale);
            }
            scores.resize(heads * len);
            // visit(g, rows, n, t0) for each tile of the sequence's keys and each of the item's KV heads g,
            // the n rows as float32; `base` is the pool at the K or V half of a page.
            const auto each_tile = [&](const T* base, auto&& visit) {
                for (int64_t t0 = 0; t0 < len; t0 += kTile) {
                    const int64_t n = std::min<int64_t>(kTile, len - t0);
                    tile_slots(base, table, t0, n, len, block_size, s_block, s_slot, slots, ahead);
                    for (int64_t g = g0; g < g1; ++g) {
                        prefetch_rows(ahead, n, g * s_head, dim * sizeof(T));
                        tile_rows(row, slots, n, g * s_head, scratch.data(), rows);
                        visit(g, rows, n, t0);
                    }
                }
            };
            each_tile(pages, [&](int64_t g, const float* const* keys, int64_t n, int64_t t0) {
                for (int64_t h = g * group; h < (g + 1) * group; ++h)   // every key, once, scored for its heads
                    score_tile(row, queries.data() + h * dim, keys, n, scores.data() + h * len + t0);
            });
            for (int64_t h = h0; h < h1; ++h) softmax(scores.data() + h * len, len);
            std::fill(acc.begin() + h0 * dim, acc.begin() + h1 * dim, 0.f);
            each_tile(pages + s_kv, [&](int64_t g, const float* const* values, int64_t n, int64_t t0) {
                for (int64_t h = g * group; h < (g + 1) * group; ++h)   // every value, once, weighted likewise
                    accumulate_tile(row, acc.data() + h * dim, values, n, scores.data() + h * len + t0);
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
