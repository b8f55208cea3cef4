// The C interface between the CUDA kernels (*.cu, CUDA headers only) and the torch binding (binding.cpp):
// raw pointers, sizes, a launch configuration and a stream. Each entry returns cudaSuccess, the launch
// error, or cudaErrorInvalidValue for a configuration the kernels were not built for.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fusedserve {

enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// One summand of a LayerNorm input row: row r lives at base + (index ? index[r] : r) * stride elements.
// stride 0 and no index broadcasts one vector to every row (a bias); an index gathers (an embedding table).
struct RowSource {
    const void* base;
    const int64_t* index;
    int64_t stride;
};

// y = LN(in[0] + in[1] + in[2]) * weight + ln_bias, then optional GELU; pre_norm_sum (if set) gets the sum.
struct NormArgs {
    RowSource in[3];
    int n_in;               // 1..3 summands
    const void* weight;     // [cols]
    const void* ln_bias;    // [cols]
    void* y;                // [rows, cols], row stride stride_y
    void* pre_norm_sum;     // [rows, cols], row stride stride_s, or null
    int64_t rows, cols, stride_y, stride_s;
    float eps;
    int gelu;               // 0 none, 1 exact erf, 2 tanh
};

// y = GELU(x + bias [+ residual]) over [rows, cols].
struct PointwiseArgs {
    const void* x;
    const void* bias;       // [cols]
    const void* residual;   // [rows, cols] or null
    void* y;
    int64_t rows, cols, stride_x, stride_r, stride_y;
    int gelu;               // 0 none, 1 exact erf, 2 tanh
};

// y[b] = mean(x[cu[b] : cu[b + 1]]) over [rows, cols] x, fp32 y [segments, cols] (row stride stride_y).
struct SegmentArgs {
    const void* x;
    const void* cu_seqlens;  // [segments + 1] int32 or int64
    float* y;
    int64_t rows, cols, segments, stride_x, stride_y;
};

// Widest row the LayerNorm kernels hold in registers: 512 threads x 32 values.
constexpr int kMaxNormCols = 16384;
constexpr int kNormValuesPerThread = 32;

}  // namespace fusedserve

// threads_per_row: 32, 64, 128, 256 or 512 (and threads_per_row * 32 >= cols); block_threads: 128, 256 or
// 512 (>= threads_per_row) for the vector path. vec_ok: the caller checked that every pointer and
// row stride is 16-byte aligned and cols is a multiple of the vector width; without it the scalar path
// runs with max(256, threads_per_row) threads per block.
cudaError_t fusedserve_launch_norm(int dtype, bool vec_ok, int threads_per_row, int block_threads,
                                   const fusedserve::NormArgs& args, cudaStream_t stream);

// block_threads: 64..1024, a multiple of 32; rows_per_thread >= 1 (rows each thread walks, so the grid's
// second dimension is rows / (block rows * rows_per_thread)).
cudaError_t fusedserve_launch_pointwise(int dtype, bool vec_ok, int block_threads, int rows_per_thread,
                                        const fusedserve::PointwiseArgs& args, cudaStream_t stream);

// vec_ok: x's base pointer and row stride are 16-byte aligned and cols is a multiple of the vector width;
// index64: cu_seqlens is int64 (else int32).
cudaError_t fusedserve_launch_segment_mean(int dtype, bool vec_ok, bool index64, const fusedserve::SegmentArgs& args,
                                           cudaStream_t stream);
