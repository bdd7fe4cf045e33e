// A layer's small steps on the CPU as one op each: RMS norm, and RoPE with the new K/V's store into the pages.
//
// In a decode step of a small model each of these is a handful of tiny torch ops (F.rms_norm alone runs
// seven, with their allocations and dispatch), and together they took a third of the step's time: 16 rows of
// the bench model spent 36 us in each of the pass's nine norms. Here each is one pass over the rows.
//
// Each op rounds where the torch ops it stands for round, so results match them: RoPE and the store bit for
// bit in every dtype (the library is compiled without contracting a product and a sum into one fused
// multiply-add, which would round once where torch rounds twice); the norm to the last bits of float32 (its
// sum of squares is added in another order), and bit for bit after rounding to bfloat16 or float16 almost
// always.
//
// Built by inferd.paged_kernel into the same library as the paged attention kernel.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// A value of T as float, and a float rounded to T (to nearest even, as torch rounds).
template <typename T>
inline float wide(T x) { return static_cast<float>(x); }
template <typename T>
inline T narrow(float x) { return static_cast<T>(x); }

// Rows per work item: one item below this much work, so a decode step's few rows never wake other threads.
inline int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, (int64_t{1} << 14) / row_elements); }

// out = weight * (x / sqrt(mean(x^2) + eps)), as transformers' Llama RMS norm: the sum in float32, the
// normalised row rounded to x's dtype, then multiplied by the weight in that dtype.
template <typename T>
void norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
    const int64_t rows = x.size(0), hidden = x.size(1), stride = x.stride(0);
    const T* src = x.const_data_ptr<T>();
    const T* w = weight.const_data_ptr<T>();
    T* dst = out.mutable_data_ptr<T>();
    at::parallel_for(0, rows, grain(hidden), [&](int64_t begin, int64_t end) {
        constexpr int kLanes = 16;
        for (int64_t r = begin; r < end; ++r) {
            const T* row = src + r * stride;
            float lanes[kLanes] = {};
            int64_t i = 0;
            for (; i + kLanes <= hidden; i += kLanes)
                for (int l = 0; l < kLanes; ++l) lanes[l] += wide(row[i + l]) * wide(row[i + l]);
            float sum = 0.f;
            for (; i < hidden; ++i) sum += wide(row[i]) * wide(row[i]);
            for (int l = 0; l < kLanes; ++l) sum += lanes[l];
            const float scale = 1.f / std::sqrt(sum / static_cast<float>(hidden) + static_cast<float>(eps));
            T* o = dst + r * hidden;
            for (int64_t j = 0; j < hidden; ++j) {
                const T normed = narrow<T>(wide(row[j]) * scale);
                o[j] = narrow<T>(wide(w[j]) * wide(normed));
            }
        }
    });
}

// x [rows, hidden] (each row contiguous), weight [hidden] -> [rows, hidden].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
    TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1),
                "rms_norm: x [rows, hidden] and weight [hidden]");
    TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight dtypes differ");
    TORCH_CHECK(x.stride(1) == 1 && weight.is_contiguous(), "rms_norm: rows and weight must be contiguous");
    at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
    switch (x.scalar_type()) {
        case at::kFloat: norm_rows<float>(x, weight, eps, out); break;
        case at::kBFloat16: norm_rows<c10::BFloat16>(x, weight, eps, out); break;
        case at::kHalf: norm_rows<c10::Half>(x, weight, eps, out); break;
        default: TORCH_CHECK(false, "rms_norm: float32, bfloat16 or float16 only, not ", x.scalar_type());
    }
    return out;
}

// Each of a token's query and key heads rotated in place, head[i] * cos[i] + turned[i] * signed_sin[i],
// where turned is the head rolled by half its length and signed_sin is (-sin, sin): rotate_half, with each
// product and the sum rounded to T as torch's mul, mul and add round them. Then the token's K and V rows
// are stored in its slot of the pages.
template <typename T>
void rope_rows(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& cache,
               const int64_t* blocks, const int64_t* offsets, int64_t heads, int64_t kv_heads) {
    const int64_t tokens = qkv.size(0), dim = cache.size(4), half = dim / 2, row_stride = qkv.stride(0);
    const int64_t s_block = cache.stride(0), s_kv = cache.stride(1), s_slot = cache.stride(2),
                  s_head = cache.stride(3);
    T* rows = qkv.mutable_data_ptr<T>();
    const T* cos_data = cos.const_data_ptr<T>();
    const T* sin_data = sin.const_data_ptr<T>();
    T* pages = cache.mutable_data_ptr<T>();
    at::parallel_for(0, tokens, grain((heads + 2 * kv_heads) * dim), [&](int64_t begin, int64_t end) {
        std::vector<T> head(dim);
        for (int64_t t = begin; t < end; ++t) {
            T* row = rows + t * row_stride;
            const T* c = cos_data + t * dim;
            const T* s = sin_data + t * dim;
            for (int64_t h = 0; h < heads + kv_heads; ++h) {
                T* x = row + h * dim;
                std::copy(x, x + dim, head.begin());
                for (int64_t i = 0; i < dim; ++i) {
                    const T turned = head[i < half ? i + half : i - half];
                    const T straight = narrow<T>(wide(head[i]) * wide(c[i]));
                    const T across = narrow<T>(wide(turned) * wide(s[i]));
                    x[i] = narrow<T>(wide(straight) + wide(across));
                }
            }
            T* slot = pages + blocks[t] * s_block + offsets[t] * s_slot;
            for (int64_t kv = 0; kv < 2; ++kv)
                for (int64_t g = 0; g < kv_heads; ++g) {
                    const T* from = row + (heads + kv * kv_heads + g) * dim;
                    std::copy(from, from + dim, slot + kv * s_kv + g * s_head);
                }
        }
    });
}

// qkv [tokens, (heads + 2 kv_heads) dim], rows of Q, K and V heads (Q and K rotated in place); cos and
// signed_sin [tokens, 1, dim]; cache [blocks, 2 (K, V), block_size, kv_heads, dim], one layer's pages;
// blocks and offsets [tokens] int64, each token's slot.
void rope_store(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& signed_sin, at::Tensor cache,
                const at::Tensor& blocks, const at::Tensor& offsets, int64_t heads, int64_t kv_heads) {
    TORCH_CHECK(qkv.dim() == 2 && cache.dim() == 5 && cache.size(1) == 2,
                "rope_store: qkv [tokens, width] and cache [blocks, 2, block_size, kv_heads, dim]");
    const int64_t tokens = qkv.size(0), dim = cache.size(4);
    TORCH_CHECK(heads > 0 && kv_heads == cache.size(3) && dim % 2 == 0 && qkv.size(1) == (heads + 2 * kv_heads) * dim,
                "rope_store: qkv's width is not (heads + 2 kv_heads) x the cache's head size");
    TORCH_CHECK(cos.numel() == tokens * dim && signed_sin.numel() == tokens * dim && cos.is_contiguous() &&
                    signed_sin.is_contiguous(), "rope_store: cos and signed_sin are [tokens, 1, dim], contiguous");
    TORCH_CHECK(qkv.scalar_type() == cache.scalar_type() && cos.scalar_type() == qkv.scalar_type() &&
                    signed_sin.scalar_type() == qkv.scalar_type(), "rope_store: dtypes differ");
    TORCH_CHECK(qkv.stride(1) == 1 && cache.stride(4) == 1, "rope_store: rows and heads must be contiguous");
    TORCH_CHECK(blocks.dim() == 1 && offsets.dim() == 1 && blocks.size(0) == tokens && offsets.size(0) == tokens &&
                    blocks.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong,
                "rope_store: one int64 block and offset per token");
    const at::Tensor b = blocks.contiguous(), o = offsets.contiguous();
    const int64_t* block_data = b.const_data_ptr<int64_t>();
    const int64_t* offset_data = o.const_data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t) {             // a bad slot must not write outside the pool
        TORCH_CHECK(block_data[t] >= 0 && block_data[t] < cache.size(0), "rope_store: block ", block_data[t],
                    " outside the pool's ", cache.size(0));
        TORCH_CHECK(offset_data[t] >= 0 && offset_data[t] < cache.size(2), "rope_store: offset ", offset_data[t],
                    " outside a block's ", cache.size(2), " slots");
    }
    switch (qkv.scalar_type()) {
        case at::kFloat:
            rope_rows<float>(qkv, cos, signed_sin, cache, block_data, offset_data, heads, kv_heads);
            break;
        case at::kBFloat16:
            rope_rows<c10::BFloat16>(qkv, cos, signed_sin, cache, block_data, offset_data, heads, kv_heads);
            break;
        case at::kHalf:
            rope_rows<c10::Half>(qkv, cos, signed_sin, cache, block_data, offset_data, heads, kv_heads);
            break;
        default: TORCH_CHECK(false, "rope_store: float32, bfloat16 or float16 only, not ", qkv.scalar_type());
    }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpool, m) {
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
    m.def("rope_store(Tensor(a!) qkv, Tensor cos, Tensor signed_sin, Tensor(b!) cache, Tensor blocks, "
          "Tensor offsets, int heads, int kv_heads) -> ()");
}

TORCH_LIBRARY_IMPL(kvpool, CPU, m) {
    m.impl("rms_norm", &rms_norm);
    m.impl("rope_store", &rope_store);
}
