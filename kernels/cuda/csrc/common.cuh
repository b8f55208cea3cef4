// Device helpers shared by the kernels: dtype conversion, 16-byte vector loads/stores, warp reductions, GELU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace fusedserve {

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// VEC elements of T moved as one aligned unit (16 bytes when VEC * sizeof(T) == 16)
template <typename T, int VEC> struct alignas(sizeof(T) * VEC) Pack {
    T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ void load(const T* __restrict__ p, float* out) {
    const Pack<T, VEC> pack = *reinterpret_cast<const Pack<T, VEC>*>(p);
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = to_float(pack.v[k]);
}

template <typename T, int VEC>
__device__ __forceinline__ void store(T* __restrict__ p, const float* in) {
    Pack<T, VEC> pack;
#pragma unroll
    for (int k = 0; k < VEC; ++k) pack.v[k] = from_float<T>(in[k]);
    *reinterpret_cast<Pack<T, VEC>*>(p) = pack;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// mode 1: exact GELU 0.5 h (1 + erf(h / sqrt 2)) (BERT); mode 2: the tanh approximation; else identity.
__device__ __forceinline__ float gelu(float h, int mode) {
    if (mode == 1) return 0.5f * h * (1.f + erff(h * 0.70710678118654752f));
    if (mode == 2) return 0.5f * h * (1.f + tanhf(0.79788456080286536f * (h + 0.044715f * h * h * h)));
    return h;
}

template <typename T> constexpr int vec_width() { return 16 / static_cast<int>(sizeof(T)); }

}  // namespace fusedserve
