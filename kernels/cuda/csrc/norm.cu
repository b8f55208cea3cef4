// LayerNorm family for the CUDA backend: y = LN(x [+ residual] [+ bias]) [-> GELU], optionally storing the
// pre-norm sum. CUDA headers only (raw pointers, sizes, a stream); the torch binding lives in binding.cpp.
//
// Layout: each row is owned by THREADS_PER_ROW threads (one warp for rows up to 1024 columns, up to 16 warps
// for 16384); a block holds several rows when rows are narrow. Every thread keeps its 32 values in registers
// (register-resident two-pass: mean, then variance of the centred values; fp32 accumulation), so x is read once
// and y written once. VEC > 1 uses 16-byte loads/stores when the launcher has checked alignment; VEC == 1 is
// the scalar path for odd widths and misaligned pointers.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

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
    Pack<T, VEC> pack = *reinterpret_cast<const Pack<T, VEC>*>(p);
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

// Sum over the THREADS_PER_ROW threads of one row: warp shuffles, then shared memory across the row's warps.
template <int THREADS_PER_ROW, int ROWS_PER_BLOCK>
__device__ __forceinline__ float row_sum(float v, float (*scratch)[THREADS_PER_ROW / 32 > 0 ? THREADS_PER_ROW / 32 : 1],
                                         int row_in_block, int thread_in_row) {
    v = warp_sum(v);
    if constexpr (THREADS_PER_ROW > 32) {
        constexpr int WARPS = THREADS_PER_ROW / 32;
        if ((thread_in_row & 31) == 0) scratch[row_in_block][thread_in_row >> 5] = v;
        __syncthreads();
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) total += scratch[row_in_block][w];
        __syncthreads();  // scratch is reused by the next reduction
        return total;
    }
    return v;
}

struct NormArgs {
    const void* x;         // [rows, cols], row stride stride_x
    const void* residual;  // [rows, cols] or null
    const void* bias;      // [cols] added before the norm, or null
    const void* weight;    // [cols]
    const void* ln_bias;   // [cols]
    void* y;               // [rows, cols], row stride stride_y
    void* pre_norm_sum;    // [rows, cols] or null
    int64_t rows;
    int64_t cols;
    int64_t stride_x, stride_r, stride_y, stride_s;
    float eps;
    int gelu;  // 0 none, 1 exact erf, 2 tanh
};

constexpr int VALUES_PER_THREAD = 32;

template <typename T, int VEC, int THREADS_PER_ROW, int ROWS_PER_BLOCK>
__global__ void __launch_bounds__(THREADS_PER_ROW * ROWS_PER_BLOCK)
norm_kernel(NormArgs a) {
    constexpr int ITERS = VALUES_PER_THREAD / VEC;
    __shared__ float scratch[ROWS_PER_BLOCK][THREADS_PER_ROW / 32 > 0 ? THREADS_PER_ROW / 32 : 1];
    const int row_in_block = threadIdx.x / THREADS_PER_ROW;
    const int thread_in_row = threadIdx.x % THREADS_PER_ROW;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * ROWS_PER_BLOCK + row_in_block;
    const bool active = row < a.rows;  // inactive threads still join the block-wide barriers
    const T* __restrict__ x = static_cast<const T*>(a.x) + (active ? row * a.stride_x : 0);
    const T* __restrict__ r = static_cast<const T*>(a.residual) + (active && a.residual ? row * a.stride_r : 0);
    const T* __restrict__ bias = static_cast<const T*>(a.bias);
    const T* __restrict__ w = static_cast<const T*>(a.weight);
    const T* __restrict__ b = static_cast<const T*>(a.ln_bias);

    float v[VALUES_PER_THREAD];
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
        const int64_t c = (static_cast<int64_t>(i) * THREADS_PER_ROW + thread_in_row) * VEC;
        float* h = v + i * VEC;
        if (active && c < a.cols) {
            load<T, VEC>(x + c, h);
            if (a.residual) {
                float t[VEC];
                load<T, VEC>(r + c, t);
#pragma unroll
                for (int k = 0; k < VEC; ++k) h[k] += t[k];
            }
            if (a.bias) {
                float t[VEC];
                load<T, VEC>(bias + c, t);
#pragma unroll
                for (int k = 0; k < VEC; ++k) h[k] += t[k];
            }
            if (a.pre_norm_sum) store<T, VEC>(static_cast<T*>(a.pre_norm_sum) + row * a.stride_s + c, h);
#pragma unroll
            for (int k = 0; k < VEC; ++k) sum += h[k];
        } else {
#pragma unroll
            for (int k = 0; k < VEC; ++k) h[k] = 0.f;
        }
    }
    // mean = sum(h) / N; var = sum((h - mean)^2) / N
    const float inv_n = 1.f / static_cast<float>(a.cols);
    const float mean = row_sum<THREADS_PER_ROW, ROWS_PER_BLOCK>(sum, scratch, row_in_block, thread_in_row) * inv_n;
    float sq = 0.f;
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
        const int64_t c = (static_cast<int64_t>(i) * THREADS_PER_ROW + thread_in_row) * VEC;
        if (active && c < a.cols) {
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                const float d = v[i * VEC + k] - mean;
                sq += d * d;
            }
        }
    }
    const float rstd = rsqrtf(row_sum<THREADS_PER_ROW, ROWS_PER_BLOCK>(sq, scratch, row_in_block, thread_in_row) * inv_n + a.eps);
    if (!active) return;
    T* __restrict__ y = static_cast<T*>(a.y) + row * a.stride_y;
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
        const int64_t c = (static_cast<int64_t>(i) * THREADS_PER_ROW + thread_in_row) * VEC;
        if (c >= a.cols) continue;
        float wv[VEC], bv[VEC], out[VEC];
        load<T, VEC>(w + c, wv);
        load<T, VEC>(b + c, bv);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            float o = (v[i * VEC + k] - mean) * rstd * wv[k] + bv[k];
            if (a.gelu == 1) {
                o = 0.5f * o * (1.f + erff(o * 0.70710678118654752f));
            } else if (a.gelu == 2) {
                o = 0.5f * o * (1.f + tanhf(0.79788456080286536f * (o + 0.044715f * o * o * o)));
            }
            out[k] = o;
        }
        store<T, VEC>(y + c, out);
    }
}

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

template <typename T, int VEC>
cudaError_t launch_typed(const NormArgs& a, cudaStream_t stream) {
    const int64_t per_row = a.cols;
    auto blocks = [&](int rows_per_block) {
        return static_cast<unsigned>((a.rows + rows_per_block - 1) / rows_per_block);
    };
    if (per_row <= 32LL * VALUES_PER_THREAD) {
        norm_kernel<T, VEC, 32, 8><<<blocks(8), 256, 0, stream>>>(a);
    } else if (per_row <= 128LL * VALUES_PER_THREAD) {
        norm_kernel<T, VEC, 128, 2><<<blocks(2), 256, 0, stream>>>(a);
    } else if (per_row <= 256LL * VALUES_PER_THREAD) {
        norm_kernel<T, VEC, 256, 1><<<blocks(1), 256, 0, stream>>>(a);
    } else if (per_row <= 512LL * VALUES_PER_THREAD) {
        norm_kernel<T, VEC, 512, 1><<<blocks(1), 512, 0, stream>>>(a);
    } else {
        return cudaErrorInvalidValue;  // wider than 16384 columns
    }
    return cudaGetLastError();
}

}  // namespace fusedserve

// The C++ entry point binding.cpp calls. `vec_ok`: the caller checked that every row start of every
// [rows, cols] tensor and of the vectors is 16-byte aligned and cols is a multiple of the vector width.
cudaError_t fusedserve_launch_norm(int dtype, bool vec_ok, const fusedserve::NormArgs& args, cudaStream_t stream) {
    using namespace fusedserve;
    if (args.rows == 0) return cudaSuccess;
    switch (static_cast<DType>(dtype)) {
        case DType::kFloat32:
            return vec_ok ? launch_typed<float, 4>(args, stream) : launch_typed<float, 1>(args, stream);
        case DType::kFloat16:
            return vec_ok ? launch_typed<__half, 8>(args, stream) : launch_typed<__half, 1>(args, stream);
        case DType::kBFloat16:
            return vec_ok ? launch_typed<__nv_bfloat16, 8>(args, stream) : launch_typed<__nv_bfloat16, 1>(args, stream);
    }
    return cudaErrorInvalidValue;
}
