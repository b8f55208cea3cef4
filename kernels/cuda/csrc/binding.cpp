// Torch glue for the CUDA kernels: argument checks with clear errors, the 16-byte alignment test that picks
// the vector path, PyTorch's current stream, and registration as torch library ops (torch.ops.fusedserve_cuda.*).
// Outputs are passed in (out= style) so the Python side owns allocation and the registry can poison them.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "fusedserve_cuda.h"

namespace {

using at::Tensor;
using c10::optional;

int dtype_code(const Tensor& t, const char* op) {
    switch (t.scalar_type()) {
        case at::kFloat: return fusedserve::kFloat32;
        case at::kHalf: return fusedserve::kFloat16;
        case at::kBFloat16: return fusedserve::kBFloat16;
        default: TORCH_CHECK(false, op, ": unsupported dtype ", t.scalar_type(), " (float32, float16, bfloat16)");
    }
    return -1;
}

void check_tensor(const Tensor& t, const Tensor& like, const char* op, const char* name) {
    TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got ", t.device());
    TORCH_CHECK(t.device() == like.device(), op, ": ", name, " is on ", t.device(), ", x on ", like.device());
    TORCH_CHECK(t.scalar_type() == like.scalar_type(), op, ": ", name, " has dtype ", t.scalar_type(),
                ", expected ", like.scalar_type());
}

// [rows, cols] with unit column stride (row stride free)
void check_rows(const Tensor& t, const Tensor& like, int64_t rows, int64_t cols, const char* op, const char* name) {
    check_tensor(t, like, op, name);
    TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, op, ": ", name, " must be [", rows, ", ",
                cols, "], got ", t.sizes());
    TORCH_CHECK(cols <= 1 || t.stride(1) == 1, op, ": ", name, " must have unit column stride");
}

void check_vector(const Tensor& t, const Tensor& like, int64_t cols, const char* op, const char* name) {
    check_tensor(t, like, op, name);
    TORCH_CHECK(t.dim() == 1 && t.size(0) == cols && (cols <= 1 || t.stride(0) == 1), op, ": ", name,
                " must be a contiguous [", cols, "] vector, got ", t.sizes());
}

void check_index(const Tensor& t, const Tensor& like, int64_t rows, const char* op, const char* name) {
    TORCH_CHECK(t.device() == like.device(), op, ": ", name, " is on ", t.device(), ", tables on ", like.device());
    TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == rows && t.is_contiguous(), op, ": ",
                name, " must be a contiguous int64 [", rows, "] vector");
}

// 16-byte vector access is legal when every base pointer and row stride is 16-byte aligned and cols is a
// multiple of the vector width (slices of a wider buffer often are not: they take the scalar path).
struct Alignment {
    int64_t vec;
    bool ok = true;
    explicit Alignment(const Tensor& like, int64_t cols) : vec(16 / like.element_size()) { ok = cols % vec == 0; }
    void add(const Tensor& t, int64_t row_stride) {
        ok = ok && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && row_stride % vec == 0;
    }
};

void check_launch(cudaError_t err, const char* op) {
    TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err),
                err == cudaErrorInvalidValue ? " (unsupported launch configuration or shape)" : "");
}

// The part of a LayerNorm-family call both entry points share, once its summed inputs are in `a`: the affine
// parameters and the output (checked by the caller), sizes, then the launch on the current stream.
void launch_norm(fusedserve::NormArgs& a, Alignment& align, int dtype, const Tensor& weight, const Tensor& ln_bias,
                 Tensor& y, int64_t rows, int64_t cols, double eps, int64_t threads_per_row, int64_t block_threads,
                 const char* op) {
    align.add(weight, 0);
    align.add(ln_bias, 0);
    align.add(y, y.stride(0));
    a.weight = weight.data_ptr();
    a.ln_bias = ln_bias.data_ptr();
    a.y = y.data_ptr();
    a.stride_y = y.stride(0);
    a.rows = rows;
    a.cols = cols;
    a.eps = static_cast<float>(eps);
    const c10::cuda::CUDAGuard guard(y.device());
    check_launch(fusedserve_launch_norm(dtype, align.ok, static_cast<int>(threads_per_row),
                                        static_cast<int>(block_threads), a,
                                        c10::cuda::getCurrentCUDAStream(y.device().index())),
                 op);
}

// y = [GELU](LN(x [+ residual] [+ bias]) * weight + ln_bias); pre_norm_sum gets the sum when given.
void norm(const Tensor& x, const optional<Tensor>& residual, const optional<Tensor>& bias, const Tensor& weight,
          const Tensor& ln_bias, double eps, int64_t gelu, Tensor& y, const optional<Tensor>& pre_norm_sum,
          int64_t threads_per_row, int64_t block_threads) {
    const char* op = "fusedserve_cuda.norm";
    TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D [rows, cols], got ", x.sizes());
    const int64_t rows = x.size(0), cols = x.size(1);
    TORCH_CHECK(cols >= 1 && cols <= fusedserve::kMaxNormCols, op, ": rows of ", cols,
                " elements are outside the CUDA backend's 1..", fusedserve::kMaxNormCols);
    const int dtype = dtype_code(x, op);
    check_rows(x, x, rows, cols, op, "x");
    check_rows(y, x, rows, cols, op, "y");
    check_vector(weight, x, cols, op, "weight");
    check_vector(ln_bias, x, cols, op, "ln_bias");
    Alignment align(x, cols);
    fusedserve::NormArgs a{};
    a.in[a.n_in++] = {x.data_ptr(), nullptr, x.stride(0)};
    align.add(x, x.stride(0));
    if (residual) {
        check_rows(*residual, x, rows, cols, op, "residual");
        a.in[a.n_in++] = {residual->data_ptr(), nullptr, residual->stride(0)};
        align.add(*residual, residual->stride(0));
    }
    if (bias) {
        check_vector(*bias, x, cols, op, "bias");
        a.in[a.n_in++] = {bias->data_ptr(), nullptr, 0};
        align.add(*bias, 0);
    }
    if (pre_norm_sum) {
        check_rows(*pre_norm_sum, x, rows, cols, op, "pre_norm_sum");
        a.pre_norm_sum = pre_norm_sum->data_ptr();
        a.stride_s = pre_norm_sum->stride(0);
        align.add(*pre_norm_sum, a.stride_s);
    }
    a.gelu = static_cast<int>(gelu);
    launch_norm(a, align, dtype, weight, ln_bias, y, rows, cols, eps, threads_per_row, block_threads, op);
}

// y = LN(word[ids] + position[pos] + token_type[types]) * weight + bias
void embedding_norm(const Tensor& ids, const Tensor& pos, const Tensor& types, const Tensor& word,
                    const Tensor& position, const Tensor& token_type, const Tensor& weight, const Tensor& bias,
                    double eps, Tensor& y, int64_t threads_per_row, int64_t block_threads) {
    const char* op = "fusedserve_cuda.embedding_norm";
    TORCH_CHECK(word.dim() == 2, op, ": word_embeddings must be 2-D, got ", word.sizes());
    const int64_t rows = ids.numel(), cols = word.size(1);
    TORCH_CHECK(cols >= 1 && cols <= fusedserve::kMaxNormCols, op, ": rows of ", cols,
                " elements are outside the CUDA backend's 1..", fusedserve::kMaxNormCols);
    const int dtype = dtype_code(word, op);
    check_rows(word, word, word.size(0), cols, op, "word_embeddings");
    check_rows(position, word, position.size(0), cols, op, "position_embeddings");
    check_rows(token_type, word, token_type.size(0), cols, op, "token_type_embeddings");
    check_rows(y, word, rows, cols, op, "y");
    check_vector(weight, word, cols, op, "weight");
    check_vector(bias, word, cols, op, "bias");
    check_index(ids, word, rows, op, "input_ids");
    check_index(pos, word, rows, op, "position_ids");
    check_index(types, word, rows, op, "token_type_ids");
    Alignment align(word, cols);
    fusedserve::NormArgs a{};
    a.n_in = 3;
    a.in[0] = {word.data_ptr(), ids.data_ptr<int64_t>(), word.stride(0)};
    a.in[1] = {position.data_ptr(), pos.data_ptr<int64_t>(), position.stride(0)};
    a.in[2] = {token_type.data_ptr(), types.data_ptr<int64_t>(), token_type.stride(0)};
    for (const Tensor* t : {&word, &position, &token_type}) align.add(*t, t->stride(0));
    launch_norm(a, align, dtype, weight, bias, y, rows, cols, eps, threads_per_row, block_threads, op);
}

// y = [GELU](x + bias [+ residual])
void bias_act(const Tensor& x, const Tensor& bias, const optional<Tensor>& residual, int64_t gelu, Tensor& y,
              int64_t block_threads, int64_t rows_per_thread) {
    const char* op = "fusedserve_cuda.bias_act";
    TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D [rows, cols], got ", x.sizes());
    const int64_t rows = x.size(0), cols = x.size(1);
    const int dtype = dtype_code(x, op);
    check_rows(x, x, rows, cols, op, "x");
    check_rows(y, x, rows, cols, op, "y");
    check_vector(bias, x, cols, op, "bias");
    Alignment align(x, cols);
    fusedserve::PointwiseArgs a{};
    a.x = x.data_ptr();
    a.bias = bias.data_ptr();
    a.y = y.data_ptr();
    a.stride_x = x.stride(0);
    a.stride_y = y.stride(0);
    align.add(x, a.stride_x);
    align.add(y, a.stride_y);
    align.add(bias, 0);
    if (residual) {
        check_rows(*residual, x, rows, cols, op, "residual");
        a.residual = residual->data_ptr();
        a.stride_r = residual->stride(0);
        align.add(*residual, a.stride_r);
    }
    a.rows = rows;
    a.cols = cols;
    a.gelu = static_cast<int>(gelu);
    const c10::cuda::CUDAGuard guard(x.device());
    check_launch(fusedserve_launch_pointwise(dtype, align.ok, static_cast<int>(block_threads),
                                             static_cast<int>(rows_per_thread), a,
                                             c10::cuda::getCurrentCUDAStream(x.device().index())),
                 op);
}

// y[b] = mean(x[cu_seqlens[b] : cu_seqlens[b + 1]]), y float32 [segments, cols]
void segment_mean(const Tensor& x, const Tensor& cu_seqlens, Tensor& y) {
    const char* op = "fusedserve_cuda.segment_mean";
    TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D [rows, cols], got ", x.sizes());
    const int64_t rows = x.size(0), cols = x.size(1);
    const int dtype = dtype_code(x, op);
    check_rows(x, x, rows, cols, op, "x");
    TORCH_CHECK(cu_seqlens.device() == x.device(), op, ": cu_seqlens is on ", cu_seqlens.device(), ", x on ",
                x.device());
    TORCH_CHECK((cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong) &&
                    cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1 && cu_seqlens.is_contiguous(),
                op, ": cu_seqlens must be a contiguous int32/int64 [segments + 1] vector");
    const int64_t segments = cu_seqlens.numel() - 1;
    TORCH_CHECK(y.is_cuda() && y.device() == x.device() && y.scalar_type() == at::kFloat && y.dim() == 2 &&
                    y.size(0) == segments && y.size(1) == cols && (cols <= 1 || y.stride(1) == 1),
                op, ": y must be a float32 [", segments, ", ", cols, "] tensor with unit column stride");
    Alignment align(x, cols);
    align.add(x, x.stride(0));
    fusedserve::SegmentArgs a{};
    a.x = x.data_ptr();
    a.cu_seqlens = cu_seqlens.data_ptr();
    a.y = y.data_ptr<float>();
    a.rows = rows;
    a.cols = cols;
    a.segments = segments;
    a.stride_x = x.stride(0);
    a.stride_y = y.stride(0);
    const c10::cuda::CUDAGuard guard(x.device());
    check_launch(fusedserve_launch_segment_mean(dtype, align.ok, cu_seqlens.scalar_type() == at::kLong, a,
                                                c10::cuda::getCurrentCUDAStream(x.device().index())),
                 op);
}

}  // namespace

TORCH_LIBRARY(fusedserve_cuda, m) {
    m.def("norm(Tensor x, Tensor? residual, Tensor? bias, Tensor weight, Tensor ln_bias, float eps, int gelu, "
          "Tensor(a!) y, Tensor(b!)? pre_norm_sum, int threads_per_row, int block_threads) -> ()");
    m.def("embedding_norm(Tensor input_ids, Tensor position_ids, Tensor token_type_ids, Tensor word_embeddings, "
          "Tensor position_embeddings, Tensor token_type_embeddings, Tensor weight, Tensor bias, float eps, "
          "Tensor(a!) y, int threads_per_row, int block_threads) -> ()");
    m.def("bias_act(Tensor x, Tensor bias, Tensor? residual, int gelu, Tensor(a!) y, int block_threads, "
          "int rows_per_thread) -> ()");
    m.def("segment_mean(Tensor x, Tensor cu_seqlens, Tensor(a!) y) -> ()");
}

TORCH_LIBRARY_IMPL(fusedserve_cuda, CUDA, m) {
    m.impl("norm", &norm);
    m.impl("embedding_norm", &embedding_norm);
    m.impl("bias_act", &bias_act);
    m.impl("segment_mean", &segment_mean);
}
