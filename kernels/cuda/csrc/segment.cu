// Mean of each segment of rows for the CUDA backend: y[b] = mean(x[cu[b] : cu[b + 1]]) in fp32, the mean pooling
// of a packed batch. CUDA headers only; binding.cpp is the torch glue.
//
// Layout: one block per (segment, column slice); threadIdx.x over column vectors (VEC elements, one 16-byte load
// when aligned), threadIdx.y over the segment's rows (a block-stride loop), then the ROWS partial sums of each
// column are added through shared memory. Rows past the last offset (filler tokens) are never read; an empty
// segment writes zeros; offsets are clamped to [0, rows].
#include "common.cuh"
#include "fusedserve_cuda.h"

namespace fusedserve {
namespace {

constexpr int kLanes = 32;  // column vectors per block
constexpr int kRows = 8;    // rows summed in parallel per block

template <typename Index>
__device__ __forceinline__ int64_t offset(const void* cu, int64_t i, int64_t rows) {
    const int64_t v = static_cast<int64_t>(static_cast<const Index*>(cu)[i]);
    return v < 0 ? 0 : (v > rows ? rows : v);
}

template <typename T, int VEC, typename Index>
__global__ void __launch_bounds__(kLanes * kRows) segment_mean_kernel(const SegmentArgs a) {
    __shared__ float partial[kRows][kLanes * VEC];
    const int64_t seg = blockIdx.x;
    const int64_t start = offset<Index>(a.cu_seqlens, seg, a.rows);
    int64_t end = offset<Index>(a.cu_seqlens, seg + 1, a.rows);
    end = end < start ? start : end;
    const int64_t c = (static_cast<int64_t>(blockIdx.y) * kLanes + threadIdx.x) * VEC;
    float sum[VEC] = {};
    if (c < a.cols) {
        const T* __restrict__ x = static_cast<const T*>(a.x) + c;
        for (int64_t row = start + threadIdx.y; row < end; row += kRows) {
            if (VEC > 1) {
                float v[VEC];
                load<T, VEC>(x + row * a.stride_x, v);
#pragma unroll
                for (int k = 0; k < VEC; ++k) sum[k] += v[k];
            } else {
                sum[0] += to_float(x[row * a.stride_x]);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) partial[threadIdx.y][threadIdx.x * VEC + k] = sum[k];
    __syncthreads();
    if (threadIdx.y != 0 || c >= a.cols) return;
    const float scale = 1.f / static_cast<float>(end - start > 0 ? end - start : 1);
    float* __restrict__ y = a.y + seg * a.stride_y + c;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
        float total = 0.f;
#pragma unroll
        for (int r = 0; r < kRows; ++r) total += partial[r][threadIdx.x * VEC + k];
        y[k] = total * scale;  // vec_ok means cols % VEC == 0: the whole vector is in the row
    }
}

template <typename T, int VEC>
cudaError_t launch(bool index64, const SegmentArgs& a, cudaStream_t stream) {
    const int64_t slices = (a.cols + kLanes * VEC - 1) / (kLanes * VEC);
    if (a.segments > 0x7fffffffLL || slices > 65535) return cudaErrorInvalidValue;
    const dim3 grid(static_cast<unsigned>(a.segments), static_cast<unsigned>(slices));
    const dim3 block(kLanes, kRows);
    if (index64)
        segment_mean_kernel<T, VEC, int64_t><<<grid, block, 0, stream>>>(a);
    else
        segment_mean_kernel<T, VEC, int32_t><<<grid, block, 0, stream>>>(a);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_typed(bool vec_ok, bool index64, const SegmentArgs& a, cudaStream_t stream) {
    return vec_ok ? launch<T, vec_width<T>()>(index64, a, stream) : launch<T, 1>(index64, a, stream);
}

}  // namespace
}  // namespace fusedserve

cudaError_t fusedserve_launch_segment_mean(int dtype, bool vec_ok, bool index64, const fusedserve::SegmentArgs& args,
                                           cudaStream_t stream) {
    using namespace fusedserve;
    if (args.segments == 0 || args.cols == 0) return cudaSuccess;
    switch (dtype) {
        case kFloat32: return launch_typed<float>(vec_ok, index64, args, stream);
        case kFloat16: return launch_typed<__half>(vec_ok, index64, args, stream);
        case kBFloat16: return launch_typed<__nv_bfloat16>(vec_ok, index64, args, stream);
    }
    return cudaErrorInvalidValue;
}
