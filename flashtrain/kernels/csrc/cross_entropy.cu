// Fused cross-entropy of a language model's logits, one dtype per compilation (FT_CE_KIND: 0 fp32, 1 fp16, 2 bf16),
// kernels FT_KERNEL_PREFIX + _fwd / _bwd, one CTA per row of logits:
//   _fwd: lse[r] = log sum_j exp(x[r][j]) over the first `vocab` columns (one read of the row: a running maximum and
//         sum per thread, rescaled once per 16-byte vector), loss[r] = lse[r] - x[r][target[r]]; 0 where the target
//         is ignore_index, NaN where it is outside [0, vocab) (a mean loss that says so, instead of a device assert).
//   _bwd: grad[r][j] = (exp(x[r][j] - lse[r]) - [j == target[r]]) * scale for j < vocab, 0 for vocab <= j < width (a
//         head padded to aligned columns gets its whole gradient), 0 on ignored rows; scale is a device scalar
//         (the loss's incoming gradient over the counted targets: no host sync).
// The float32 logits a plain F.cross_entropy makes of bf16 ones (and its log-softmax, and their gradients) are never
// written: the forward reads the logits once, the backward reads them once and writes the gradient once.
#include "utils.cuh"

#define FT_CONCAT_(a, b) a##b
#define FT_CONCAT(a, b) FT_CONCAT_(a, b)

namespace flashtrain {

constexpr int kCeThreads = 256;  // = build.CE_THREADS

struct CeParams {  // = launch.CeParams
    const void* logits;  // (rows, row_stride) elements, the first vocab columns real
    const i64* targets;  // (rows,)
    float* lse;  // (rows,)
    float* loss;  // (rows,)
    void* grad;  // (rows, grad_row_stride), dtype of the logits
    const float* scale;  // device scalar
    i64 row_stride;
    i64 grad_row_stride;
    i64 ignore_index;
    int rows;
    int vocab;  // columns in the softmax
    int width;  // columns of grad written (>= vocab)
    int vectorized;  // rows (logits and grad) start 16-byte aligned: 16-byte loads and stores
};

#if FT_CE_KIND == 0
using Elem = float;
constexpr int kVec = 4;
__device__ __forceinline__ float to_float(Elem x) { return x; }
__device__ __forceinline__ Elem from_float(float x) { return x; }
__device__ __forceinline__ void load_vec(const Elem* p, float (&v)[kVec]) {
    const float4 f = ld_global_f4(p);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
}
__device__ __forceinline__ void store_vec(Elem* p, const float (&v)[kVec]) {
    const u32 r[4] = {__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3])};
    st_global_v4(p, r);
}
#else
using Elem = u16;
constexpr int kVec = 8;
constexpr bool kIsBF16 = FT_CE_KIND == 2;
__device__ __forceinline__ float to_float(Elem x) {
    if constexpr (kIsBF16) {
        return __uint_as_float(u32(x) << 16);
    } else {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
        return f;
    }
}
__device__ __forceinline__ Elem from_float(float x) {
    Elem h;
    if constexpr (kIsBF16) {
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    } else {
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    }
    return h;
}
__device__ __forceinline__ void load_vec(const Elem* p, float (&v)[kVec]) {
    u32 r[4];
    ld_global_v4(p, r);
#pragma unroll
    for (int i = 0; i < 4; ++i) unpack2<kIsBF16>(r[i], v[2 * i], v[2 * i + 1]);
}
__device__ __forceinline__ void store_vec(Elem* p, const float (&v)[kVec]) {
    u32 r[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) r[i] = pack2<kIsBF16>(v[2 * i], v[2 * i + 1]);
    st_global_v4(p, r);
}
#endif

// exp(x - m) where m may be -inf (then every x is -inf too: 0, never NaN)
__device__ __forceinline__ float exp_shifted(float x, float m) {
    return fast_exp2((x - (m == -infinity() ? 0.f : m)) * kLog2e);
}

// (m, s) += (m2, s2): running maxima and sums of exp(x - m)
__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
    const float mm = fmax_(m, m2);
    s = s * exp_shifted(m, mm) + s2 * exp_shifted(m2, mm);
    m = mm;
}

__device__ __forceinline__ void ce_forward(const CeParams& p) {
    const int row = blockIdx.x;
    const Elem* x = static_cast<const Elem*>(p.logits) + row * p.row_stride;
    float m = -infinity(), s = 0.f;
    int tail = 0;  // first column left to the scalar loop
    if (p.vectorized) {
        const int nvec = p.vocab / kVec;
        for (int i = threadIdx.x; i < nvec; i += kCeThreads) {
            float v[kVec];
            load_vec(x + i * kVec, v);
            float vm = v[0];
#pragma unroll
            for (int k = 1; k < kVec; ++k) vm = fmax_(vm, v[k]);
            if (vm > m) {  // a new maximum: rescale once per vector
                s *= exp_shifted(m, vm);
                m = vm;
            }
#pragma unroll
            for (int k = 0; k < kVec; ++k) s += exp_shifted(v[k], m);
        }
        tail = nvec * kVec;
    }
    for (int j = tail + threadIdx.x; j < p.vocab; j += kCeThreads) {
        const float v = to_float(x[j]);
        if (v > m) {
            s *= exp_shifted(m, v);
            m = v;
        }
        s += exp_shifted(v, m);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) combine(m, s, shfl_xor(m, offset), shfl_xor(s, offset));
    __shared__ float warp_m[kCeThreads / 32], warp_s[kCeThreads / 32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warp_m[warp] = m, warp_s[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < kCeThreads / 32; ++w) combine(m, s, warp_m[w], warp_s[w]);
        const float lse = m == -infinity() ? m : m + logf(s);
        const i64 target = p.targets[row];
        float loss = 0.f;
        if (target != p.ignore_index) {
            loss = (target >= 0 && target < p.vocab) ? lse - to_float(x[target]) : __int_as_float(0x7fc00000);
        }
        p.lse[row] = lse;
        p.loss[row] = loss;
    }
}

__device__ __forceinline__ void ce_backward(const CeParams& p) {
    const int row = blockIdx.x;
    const Elem* x = static_cast<const Elem*>(p.logits) + row * p.row_stride;
    Elem* g = static_cast<Elem*>(p.grad) + row * p.grad_row_stride;
    const i64 target = p.targets[row];
    const bool counted = target != p.ignore_index;
    const float scale = counted ? *p.scale : 0.f;
    const float lse = p.lse[row];
    // exp(x - lse) * scale = exp2(x * log2e - (lse * log2e - log2(scale))); a zero scale gives exactly 0
    const float shift = lse * kLog2e - (scale > 0.f ? fast_log2(scale) : 0.f);
    auto value = [&](float v, int j) -> float {
        if (j >= p.vocab || !counted) return 0.f;
        const float e = scale > 0.f ? fast_exp2(v * kLog2e - shift) : expf(v - lse) * scale;
        return j == target ? e - scale : e;
    };
    int tail = 0;
    if (p.vectorized) {
        const int nvec = p.width / kVec;
        for (int i = threadIdx.x; i < nvec; i += kCeThreads) {
            const int j0 = i * kVec;
            float v[kVec];
            if (j0 < p.vocab) load_vec(x + j0, v);  // the padded columns past vocab may hold anything
#pragma unroll
            for (int k = 0; k < kVec; ++k) v[k] = value(j0 < p.vocab ? v[k] : 0.f, j0 + k);
            store_vec(g + j0, v);
        }
        tail = nvec * kVec;
    }
    for (int j = tail + threadIdx.x; j < p.width; j += kCeThreads) {
        g[j] = from_float(value(j < p.vocab ? to_float(x[j]) : 0.f, j));
    }
}

}  // namespace flashtrain

extern "C" __global__ void __launch_bounds__(flashtrain::kCeThreads)
    FT_CONCAT(FT_KERNEL_PREFIX, _fwd)(const __grid_constant__ flashtrain::CeParams params) {
    flashtrain::ce_forward(params);
}
extern "C" __global__ void __launch_bounds__(flashtrain::kCeThreads)
    FT_CONCAT(FT_KERNEL_PREFIX, _bwd)(const __grid_constant__ flashtrain::CeParams params) {
    flashtrain::ce_backward(params);
}
