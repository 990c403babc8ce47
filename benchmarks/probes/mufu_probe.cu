// MUFU exponential throughput per SM (one 1024-thread block per SM, eight independent chains per thread, clock64 per
// block): ex2.approx.ftz.f32 against the packed ex2.approx.f16x2 / ex2.approx.ftz.bf16x2, which ptxas 13.0 compiles to
// two 16-bit MUFU.EX2 per pair. Prints one JSON line per form: exponentials and instructions per clock per SM.
//     nvcc -arch=sm_90a -O3 -o /tmp/mufu_probe benchmarks/probes/mufu_probe.cu && /tmp/mufu_probe
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cuda_runtime.h>

// Stops with the CUDA error's text instead of printing rates from a failed launch or copy.
static void check(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return;
    fprintf(stderr, "mufu_probe: %s: %s\n", what, cudaGetErrorString(e));
    exit(1);
}

template <int kMode> __device__ __forceinline__ uint32_t ex2_step(uint32_t x) {
    uint32_t y;
    if constexpr (kMode == 0) {  // fp32: y = -2^x
        asm volatile("{ .reg .f32 t; ex2.approx.ftz.f32 t, %1; neg.f32 %0, t; }" : "=r"(y) : "r"(x));
    } else if constexpr (kMode == 1) {  // f16x2
        asm volatile("{ .reg .b32 t; ex2.approx.f16x2 t, %1; neg.f16x2 %0, t; }" : "=r"(y) : "r"(x));
    } else {  // bf16x2
        asm volatile("{ .reg .b32 t; ex2.approx.ftz.bf16x2 t, %1; neg.bf16x2 %0, t; }" : "=r"(y) : "r"(x));
    }
    return y;
}

template <int kMode> __global__ void __launch_bounds__(1024) ex2_loop(uint32_t* out, long long* cycles, int iters) {
    uint32_t v[8];
    const uint32_t seed = kMode == 0 ? 0xbf000000u : kMode == 1 ? 0xb800b800u : 0xbf00bf00u;  // -0.5 (pairs)
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = seed + (threadIdx.x & 7) + j;
    __syncthreads();
    const long long t0 = clock64();
    for (int i = 0; i < iters; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = ex2_step<kMode>(v[j]);
    }
    __syncthreads();
    const long long t1 = clock64();
    uint32_t acc = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc ^= v[j];
    out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
    if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <int kMode> void run(const char* name, int sms, uint32_t* out, long long* cycles) {
    const int threads = 1024, iters = 4096;
    ex2_loop<kMode><<<sms, threads>>>(out, cycles, iters);  // warm-up
    ex2_loop<kMode><<<sms, threads>>>(out, cycles, iters);
    check(cudaGetLastError(), name);
    check(cudaDeviceSynchronize(), name);
    long long host[1024];
    check(cudaMemcpy(host, cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost), "cycles copy");
    double mean = 0;
    for (int b = 0; b < sms; ++b) mean += host[b];
    mean /= sms;
    const double elems = (double)threads * iters * 8 * (kMode == 0 ? 1 : 2);
    const double ops = (double)threads * iters * 8;
    printf("{\"form\": \"%s\", \"cycles\": %.0f, \"results_per_clock_per_sm\": %.2f, "
           "\"instructions_per_clock_per_sm\": %.2f}\n", name, mean, elems / mean, ops / mean);
}

int main() {
    int sms = 0;
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "device query");
    if (sms < 1 || sms > 1024) {
        fprintf(stderr, "mufu_probe: %d SMs (the probe handles 1-1024)\n", sms);
        return 1;
    }
    uint32_t* out;
    long long* cycles;
    check(cudaMalloc(&out, sms * 1024 * sizeof(uint32_t)), "allocation");
    check(cudaMalloc(&cycles, sms * sizeof(long long)), "allocation");
    run<0>("ex2.approx.ftz.f32", sms, out, cycles);
    run<1>("ex2.approx.f16x2", sms, out, cycles);
    run<2>("ex2.approx.ftz.bf16x2", sms, out, cycles);
    return 0;
}
