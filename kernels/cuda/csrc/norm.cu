// LayerNorm family for the CUDA backend: y = LN(sum of up to three row sources) -> optional GELU, optionally
// storing the pre-norm sum. One kernel serves layer_norm, layer_norm_gelu, add_layer_norm (x + residual +
// bias) and embedding_layer_norm (three gathered table rows). CUDA headers only; binding.cpp is the torch glue.
//
// Layout: THREADS_PER_ROW threads own a row (one warp up to 1024 columns, up to 16 warps for 16384); a block
// holds BLOCK / THREADS_PER_ROW rows. Each thread keeps its (at most 32) values in registers: a register-
// resident two-pass (mean, then the variance of the centred values, fp32 accumulation), so every input is read
// once and y written once. Row sums use warp shuffles, then shared memory across the row's warps.
// VEC > 1 moves 16 bytes per access (the launcher checked alignment); VEC == 1 is the scalar path.
#include "common.cuh"
#include "fusedserve_cuda.h"

namespace fusedserve {
namespace {

template <int THREADS_PER_ROW, int ROWS_PER_BLOCK>
__device__ __forceinline__ float row_sum(float v, float (*scratch)[THREADS_PER_ROW / 32], int row_in_block,
                                         int thread_in_row) {
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

template <typename T, int VEC, int THREADS_PER_ROW, int BLOCK>
__global__ void __launch_bounds__(BLOCK) norm_kernel(const NormArgs a) {
    constexpr int ROWS_PER_BLOCK = BLOCK / THREADS_PER_ROW;
    constexpr int ITERS = kNormValuesPerThread / VEC;
    __shared__ float scratch[ROWS_PER_BLOCK][THREADS_PER_ROW / 32];
    const int row_in_block = threadIdx.x / THREADS_PER_ROW;
    const int thread_in_row = threadIdx.x % THREADS_PER_ROW;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * ROWS_PER_BLOCK + row_in_block;
    const bool active = row < a.rows;  // inactive threads still take part in the block's barriers

    const T* __restrict__ src[3];
#pragma unroll
    for (int s = 0; s < 3; ++s) {
        const RowSource& in = a.in[s];
        const int64_t r = !active || s >= a.n_in ? 0 : (in.index ? in.index[row] : row);
        src[s] = static_cast<const T*>(in.base) + r * in.stride;
    }

    float v[kNormValuesPerThread];
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
        const int64_t c = (static_cast<int64_t>(i) * THREADS_PER_ROW + thread_in_row) * VEC;
        float* h = v + i * VEC;
#pragma unroll
        for (int k = 0; k < VEC; ++k) h[k] = 0.f;
        if (active && c < a.cols) {
#pragma unroll
            for (int s = 0; s < 3; ++s) {
                if (s < a.n_in) {
                    float t[VEC];
                    load<T, VEC>(src[s] + c, t);
#pragma unroll
                    for (int k = 0; k < VEC; ++k) h[k] += t[k];
                }
            }
            if (a.pre_norm_sum) store<T, VEC>(static_cast<T*>(a.pre_norm_sum) + row * a.stride_s + c, h);
#pragma unroll
            for (int k = 0; k < VEC; ++k) sum += h[k];
        }
    }
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
    const float var = row_sum<THREADS_PER_ROW, ROWS_PER_BLOCK>(sq, scratch, row_in_block, thread_in_row) * inv_n;
    const float rstd = rsqrtf(var + a.eps);
    if (!active) return;
    const T* __restrict__ w = static_cast<const T*>(a.weight);
    const T* __restrict__ b = static_cast<const T*>(a.ln_bias);
    T* __restrict__ y = static_cast<T*>(a.y) + row * a.stride_y;
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
        const int64_t c = (static_cast<int64_t>(i) * THREADS_PER_ROW + thread_in_row) * VEC;
        if (c >= a.cols) continue;
        float wv[VEC], bv[VEC], out[VEC];
        load<T, VEC>(w + c, wv);
        load<T, VEC>(b + c, bv);
#pragma unroll
        for (int k = 0; k < VEC; ++k) out[k] = gelu((v[i * VEC + k] - mean) * rstd * wv[k] + bv[k], a.gelu);
        store<T, VEC>(y + c, out);
    }
}

template <typename T, int VEC, int TPR, int BLOCK>
cudaError_t launch(const NormArgs& a, cudaStream_t stream) {
    constexpr int rows_per_block = BLOCK / TPR;
    const int64_t blocks = (a.rows + rows_per_block - 1) / rows_per_block;
    if (blocks > 0x7fffffffLL) return cudaErrorInvalidValue;
    norm_kernel<T, VEC, TPR, BLOCK><<<static_cast<unsigned>(blocks), BLOCK, 0, stream>>>(a);
    return cudaGetLastError();
}

// Vector path: every (threads per row, block size) pair the tuner may pick.
template <typename T, int VEC, int TPR>
cudaError_t launch_block(int block, const NormArgs& a, cudaStream_t stream) {
    switch (block) {
        case 128: if constexpr (TPR <= 128) return launch<T, VEC, TPR, 128>(a, stream); break;
        case 256: if constexpr (TPR <= 256) return launch<T, VEC, TPR, 256>(a, stream); break;
        case 512: return launch<T, VEC, TPR, 512>(a, stream);
    }  // 1024-thread blocks cap a thread at 64 registers: the 32 row values would spill
    return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t launch_typed(bool vec_ok, int tpr, int block, const NormArgs& a, cudaStream_t stream) {
    if (static_cast<int64_t>(tpr) * kNormValuesPerThread < a.cols) return cudaErrorInvalidValue;
    constexpr int V = vec_width<T>();
    if (vec_ok) {
        switch (tpr) {
            case 32: return launch_block<T, V, 32>(block, a, stream);
            case 64: return launch_block<T, V, 64>(block, a, stream);
            case 128: return launch_block<T, V, 128>(block, a, stream);
            case 256: return launch_block<T, V, 256>(block, a, stream);
            case 512: return launch_block<T, V, 512>(block, a, stream);
        }
        return cudaErrorInvalidValue;
    }
    switch (tpr) {  // scalar path (odd widths, misaligned views): one block shape per row width
        case 32: return launch<T, 1, 32, 256>(a, stream);
        case 64: return launch<T, 1, 64, 256>(a, stream);
        case 128: return launch<T, 1, 128, 256>(a, stream);
        case 256: return launch<T, 1, 256, 256>(a, stream);
        case 512: return launch<T, 1, 512, 512>(a, stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace
}  // namespace fusedserve

cudaError_t fusedserve_launch_norm(int dtype, bool vec_ok, int threads_per_row, int block_threads,
                                   const fusedserve::NormArgs& args, cudaStream_t stream) {
    using namespace fusedserve;
    if (args.rows == 0) return cudaSuccess;
    if (args.cols <= 0 || args.cols > kMaxNormCols || args.n_in < 1 || args.n_in > 3) return cudaErrorInvalidValue;
    switch (dtype) {
        case kFloat32: return launch_typed<float>(vec_ok, threads_per_row, block_threads, args, stream);
        case kFloat16: return launch_typed<__half>(vec_ok, threads_per_row, block_threads, args, stream);
        case kBFloat16: return launch_typed<__nv_bfloat16>(vec_ok, threads_per_row, block_threads, args, stream);
    }
    return cudaErrorInvalidValue;
}
