// bias + (residual) + GELU for the CUDA backend: y = GELU(x + bias [+ residual]) over [rows, cols].
// CUDA headers only; binding.cpp is the torch glue.
//
// Layout: a 2-D block, threadIdx.x over 16-byte column vectors, threadIdx.y over rows. Each thread loads its
// slice of the bias once, then walks rows_per_thread rows (a grid-stride loop over rows, so any row count
// fits the grid), streaming x (and residual) in and y out with one 16-byte access each per VEC elements.
#include "common.cuh"
#include "fusedserve_cuda.h"

namespace fusedserve {
namespace {

template <typename T, int VEC>
__global__ void __launch_bounds__(1024) bias_gelu_kernel(const PointwiseArgs a) {
    const int64_t c = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
    if (c >= a.cols) return;
    float bias[VEC];
    load<T, VEC>(static_cast<const T*>(a.bias) + c, bias);
    const T* __restrict__ x = static_cast<const T*>(a.x) + c;
    const T* __restrict__ r = a.residual ? static_cast<const T*>(a.residual) + c : nullptr;
    T* __restrict__ y = static_cast<T*>(a.y) + c;
    const int64_t step = static_cast<int64_t>(gridDim.y) * blockDim.y;
    for (int64_t row = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; row < a.rows; row += step) {
        float h[VEC];
        load<T, VEC>(x + row * a.stride_x, h);
        if (r) {
            float t[VEC];
            load<T, VEC>(r + row * a.stride_r, t);
#pragma unroll
            for (int k = 0; k < VEC; ++k) h[k] += t[k];
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) h[k] = gelu(h[k] + bias[k], a.gelu);
        store<T, VEC>(y + row * a.stride_y, h);
    }
}

template <typename T, int VEC>
cudaError_t launch(int block_threads, int rows_per_thread, const PointwiseArgs& a, cudaStream_t stream) {
    if (block_threads < 32 || block_threads > 1024 || block_threads % 32 || rows_per_thread < 1)
        return cudaErrorInvalidValue;
    const int64_t vectors = (a.cols + VEC - 1) / VEC;  // per row
    const int64_t bx = vectors >= block_threads ? block_threads : (vectors + 31) / 32 * 32;
    const int64_t by = block_threads / bx;
    const int64_t gx = (vectors + bx - 1) / bx;
    int64_t gy = (a.rows + by * rows_per_thread - 1) / (by * rows_per_thread);
    gy = gy < 1 ? 1 : (gy > 65535 ? 65535 : gy);
    if (gx > 0x7fffffffLL) return cudaErrorInvalidValue;
    const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
    const dim3 block(static_cast<unsigned>(bx), static_cast<unsigned>(by));
    bias_gelu_kernel<T, VEC><<<grid, block, 0, stream>>>(a);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_typed(bool vec_ok, int block_threads, int rows_per_thread, const PointwiseArgs& a,
                         cudaStream_t stream) {
    return vec_ok ? launch<T, vec_width<T>()>(block_threads, rows_per_thread, a, stream)
                  : launch<T, 1>(block_threads, rows_per_thread, a, stream);
}

}  // namespace
}  // namespace fusedserve

cudaError_t fusedserve_launch_pointwise(int dtype, bool vec_ok, int block_threads, int rows_per_thread,
                                        const fusedserve::PointwiseArgs& args, cudaStream_t stream) {
    using namespace fusedserve;
    if (args.rows == 0 || args.cols == 0) return cudaSuccess;
    switch (dtype) {
        case kFloat32: return launch_typed<float>(vec_ok, block_threads, rows_per_thread, args, stream);
        case kFloat16: return launch_typed<__half>(vec_ok, block_threads, rows_per_thread, args, stream);
        case kBFloat16: return launch_typed<__nv_bfloat16>(vec_ok, block_threads, rows_per_thread, args, stream);
    }
    return cudaErrorInvalidValue;
}
