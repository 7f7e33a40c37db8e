// The cuBLAS calls a generated runtime makes (welder tune --skip-dot), on the CPU, for running it
// under the emulator instead of a GPU.
//
// Part of the CPU emulator's host shim (see emu_host.h), header-only, included by nnfusion_rt.cu
// only when the runtime calls cuBLAS.  It covers exactly what codegen_templates/runtime/cublas.j2
// uses: handles bound to a stream and a workspace, cublasGemmStridedBatchedEx for fp32 and fp16
// data with fp32 accumulation, and the status texts.  Like the rest of the shim it checks what the
// GPU would not forgive:
//
//   * arguments as cuBLAS validates them (sizes, leading dimensions, types), with the same status;
//   * every matrix a call touches, over the whole batch, must lie inside one device allocation,
//     and the output must not overlap an input (undefined on the GPU);
//   * beta == 0 never reads C, so fresh (0xFF, NaN) output memory does not leak into results;
//   * the call is work on the handle's stream: captured into CUDA graphs and replayed like a
//     kernel launch.
//
// A failed call returns its status; cublasGetStatusString adds what the emulator found.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "emu_half.h"
#include "emu_bf16.h"
#include "emu_host.h"

// ============================================================================ types and codes

enum cublasStatus_t {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
};

enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 };

// library_types.h's names and values.
enum cudaDataType_t { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 };
typedef cudaDataType_t cudaDataType;

enum cublasComputeType_t { CUBLAS_COMPUTE_32F = 68 };
enum cublasGemmAlgo_t { CUBLAS_GEMM_DEFAULT = -1 };

struct cublasContext {
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
typedef cublasContext* cublasHandle_t;

namespace welder_emu_cublas {

// The latest failure, in words, for cublasGetStatusString.
inline cublasStatus_t g_detail_code = CUBLAS_STATUS_SUCCESS;
inline std::string g_detail;
inline std::string g_text;

inline cublasStatus_t fail(cublasStatus_t code, std::string what) {
  g_detail_code = code;
  g_detail = std::move(what);
  return code;
}

// One operand of a strided batched call: `rows` x `cols` column-major with leading dimension
// `ld`, `batch` copies `stride` elements apart.
struct Matrix {
  const char* name;
  const void* data;
  size_t element_bytes;
  int64_t rows, cols, ld, stride;

  // Bytes from `data` to one past the last element the call touches (0 if it touches none).
  size_t extent_bytes(int64_t batch) const {
    if (rows == 0 || cols == 0 || batch == 0) return 0;
    const int64_t last = (batch - 1) * stride + (cols - 1) * ld + rows;
    return static_cast<size_t>(last) * element_bytes;
  }
};

inline cublasStatus_t check_memory(const Matrix& m, int64_t batch) {
  const size_t bytes = m.extent_bytes(batch);
  if (bytes == 0) return CUBLAS_STATUS_SUCCESS;
  if (m.stride < 0) return fail(CUBLAS_STATUS_INVALID_VALUE, std::string("negative batch stride of ") + m.name);
  if (!welder_emu_host::is_device_range(m.data, bytes))
    return fail(CUBLAS_STATUS_EXECUTION_FAILED, std::string("matrix ") + m.name + " (" + std::to_string(bytes) +
                                                    " bytes over the batch) does not lie inside one device allocation");
  return CUBLAS_STATUS_SUCCESS;
}

inline bool overlaps(const Matrix& a, const Matrix& b, int64_t batch) {
  const auto* pa = static_cast<const unsigned char*>(a.data);
  const auto* pb = static_cast<const unsigned char*>(b.data);
  const size_t na = a.extent_bytes(batch), nb = b.extent_bytes(batch);
  return na > 0 && nb > 0 && pa < pb + nb && pb < pa + na;
}

inline float load(const void* p, cudaDataType type, int64_t i) {
  if (type == CUDA_R_16F) return welder_emu::detail::half_bits_to_float(static_cast<const uint16_t*>(p)[i]);
  if (type == CUDA_R_16BF) return welder_emu::detail::bf16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

inline void store(void* p, cudaDataType type, int64_t i, float v) {
  if (type == CUDA_R_16F)
    static_cast<uint16_t*>(p)[i] = welder_emu::detail::float_to_half_bits(v);
  else if (type == CUDA_R_16BF)
    static_cast<uint16_t*>(p)[i] = welder_emu::detail::float_to_bf16_bits(v);
  else
    static_cast<float*>(p)[i] = v;
}

// Element (r, c) of op(X), where X is stored column-major with leading dimension ld.
inline float element(const void* x, cudaDataType type, cublasOperation_t op, int64_t ld, int64_t r, int64_t c) {
  return op == CUBLAS_OP_N ? load(x, type, r + c * ld) : load(x, type, c + r * ld);
}

// C = alpha op(A) op(B) + beta C for each of `batch` matrices, accumulating in fp32.
struct Gemm {
  cublasOperation_t transa, transb;
  int64_t m, n, k, lda, ldb, ldc, stride_a, stride_b, stride_c, batch;
  float alpha, beta;
  const void* a;
  const void* b;
  void* c;
  cudaDataType type;

  void run() const {
    const size_t bytes = type == CUDA_R_32F ? 4 : 2;
    for (int64_t p = 0; p < batch; ++p) {
      const auto* ap = static_cast<const unsigned char*>(a) + p * stride_a * bytes;
      const auto* bp = static_cast<const unsigned char*>(b) + p * stride_b * bytes;
      auto* cp = static_cast<unsigned char*>(c) + p * stride_c * bytes;
      for (int64_t j = 0; j < n; ++j)
        for (int64_t i = 0; i < m; ++i) {
          float sum = 0.0f;
          for (int64_t l = 0; l < k; ++l)
            sum += element(ap, type, transa, lda, i, l) * element(bp, type, transb, ldb, l, j);
          const float old = beta == 0.0f ? 0.0f : beta * load(cp, type, i + j * ldc);
          store(cp, type, i + j * ldc, alpha * sum + old);
        }
    }
  }
};

inline cublasStatus_t check_arguments(const Gemm& g, cudaDataType btype, cudaDataType ctype,
                                      cublasComputeType_t compute) {
  const auto rows = [](cublasOperation_t op, int64_t r, int64_t c) { return op == CUBLAS_OP_N ? r : c; };
  if (g.transa == CUBLAS_OP_C || g.transb == CUBLAS_OP_C || g.transa < CUBLAS_OP_N || g.transb < CUBLAS_OP_N ||
      g.transa > CUBLAS_OP_C || g.transb > CUBLAS_OP_C)
    return fail(CUBLAS_STATUS_INVALID_VALUE, "transa and transb must be CUBLAS_OP_N or CUBLAS_OP_T here");
  if (g.m < 0 || g.n < 0 || g.k < 0 || g.batch < 0)
    return fail(CUBLAS_STATUS_INVALID_VALUE, "negative m, n, k or batch count");
  if (g.lda < std::max<int64_t>(1, rows(g.transa, g.m, g.k)))
    return fail(CUBLAS_STATUS_INVALID_VALUE, "lda " + std::to_string(g.lda) + " is less than the rows of A");
  if (g.ldb < std::max<int64_t>(1, rows(g.transb, g.k, g.n)))
    return fail(CUBLAS_STATUS_INVALID_VALUE, "ldb " + std::to_string(g.ldb) + " is less than the rows of B");
  if (g.ldc < std::max<int64_t>(1, g.m))
    return fail(CUBLAS_STATUS_INVALID_VALUE, "ldc " + std::to_string(g.ldc) + " is less than m");
  if (g.type != btype || g.type != ctype || (g.type != CUDA_R_32F && g.type != CUDA_R_16F && g.type != CUDA_R_16BF))
    return fail(CUBLAS_STATUS_NOT_SUPPORTED, "A, B and C must all be CUDA_R_32F, all CUDA_R_16F or all CUDA_R_16BF");
  if (compute != CUBLAS_COMPUTE_32F) return fail(CUBLAS_STATUS_NOT_SUPPORTED, "compute type must be CUBLAS_COMPUTE_32F");
  return CUBLAS_STATUS_SUCCESS;
}

inline cublasStatus_t check_operands(const Gemm& g) {
  const size_t bytes = g.type == CUDA_R_32F ? 4 : 2;
  const Matrix a{"A", g.a, bytes, g.transa == CUBLAS_OP_N ? g.m : g.k, g.transa == CUBLAS_OP_N ? g.k : g.m, g.lda,
                 g.stride_a};
  const Matrix b{"B", g.b, bytes, g.transb == CUBLAS_OP_N ? g.k : g.n, g.transb == CUBLAS_OP_N ? g.n : g.k, g.ldb,
                 g.stride_b};
  const Matrix c{"C", g.c, bytes, g.m, g.n, g.ldc, g.stride_c};
  for (const Matrix* x : {&a, &b, &c})
    if (const cublasStatus_t s = check_memory(*x, g.batch); s != CUBLAS_STATUS_SUCCESS) return s;
  if (overlaps(c, a, g.batch) || overlaps(c, b, g.batch))
    return fail(CUBLAS_STATUS_INVALID_VALUE, "the output C overlaps an input");
  // The batch's output matrices must share no element: one after another, or side by side
  // within each column's leading dimension (an output written in an interleaved layout).
  const bool stacked = g.stride_c >= (g.n - 1) * g.ldc + g.m;
  const bool side_by_side = g.stride_c >= g.m && (g.batch - 1) * g.stride_c + g.m <= g.ldc;
  if (g.batch > 1 && g.m > 0 && g.n > 0 && !stacked && !side_by_side)
    return fail(CUBLAS_STATUS_INVALID_VALUE, "the batch's output matrices overlap (stride_c too small)");
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace welder_emu_cublas

// ============================================================================ status texts

inline const char* cublasGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

// cuBLAS's text for `status`, followed by what the emulator knows about the latest failure of it.
inline const char* cublasGetStatusString(cublasStatus_t status) {
  const char* text = "unknown error";
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: text = "success"; break;
    case CUBLAS_STATUS_NOT_INITIALIZED: text = "the library was not initialized"; break;
    case CUBLAS_STATUS_ALLOC_FAILED: text = "the resource allocation failed"; break;
    case CUBLAS_STATUS_INVALID_VALUE: text = "an invalid numeric value was used as an argument"; break;
    case CUBLAS_STATUS_EXECUTION_FAILED: text = "the GPU program failed to execute"; break;
    case CUBLAS_STATUS_NOT_SUPPORTED: text = "the functionality requested is not supported"; break;
  }
  using namespace welder_emu_cublas;
  g_text = text;
  if (status != CUBLAS_STATUS_SUCCESS && status == g_detail_code && !g_detail.empty())
    g_text += " (emulator: " + g_detail + ")";
  return g_text.c_str();
}

// ============================================================================ handles

inline cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  if (handle == nullptr) return welder_emu_cublas::fail(CUBLAS_STATUS_INVALID_VALUE, "cublasCreate(nullptr)");
  *handle = new cublasContext();
  return CUBLAS_STATUS_SUCCESS;
}

inline cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  if (handle == nullptr) return welder_emu_cublas::fail(CUBLAS_STATUS_NOT_INITIALIZED, "destroying a null handle");
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

// Binds the handle to `stream`; like cuBLAS, also drops a workspace set before.
inline cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
  if (handle == nullptr) return welder_emu_cublas::fail(CUBLAS_STATUS_NOT_INITIALIZED, "cublasSetStream on a null handle");
  handle->stream = stream;
  handle->workspace = nullptr;
  handle->workspace_bytes = 0;
  return CUBLAS_STATUS_SUCCESS;
}

inline cublasStatus_t cublasSetWorkspace(cublasHandle_t handle, void* workspace, size_t bytes) {
  using namespace welder_emu_cublas;
  if (handle == nullptr) return fail(CUBLAS_STATUS_NOT_INITIALIZED, "cublasSetWorkspace on a null handle");
  if (bytes > 0 && !welder_emu_host::is_device_range(workspace, bytes))
    return fail(CUBLAS_STATUS_INVALID_VALUE, "the workspace does not lie inside one device allocation");
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
    return fail(CUBLAS_STATUS_INVALID_VALUE, "the workspace is not 256-byte aligned");
  handle->workspace = workspace;
  handle->workspace_bytes = bytes;
  return CUBLAS_STATUS_SUCCESS;
}

// ============================================================================ the product

inline cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa,
                                                 cublasOperation_t transb, int m, int n, int k, const void* alpha,
                                                 const void* A, cudaDataType Atype, int lda, long long int strideA,
                                                 const void* B, cudaDataType Btype, int ldb, long long int strideB,
                                                 const void* beta, void* C, cudaDataType Ctype, int ldc,
                                                 long long int strideC, int batchCount,
                                                 cublasComputeType_t computeType, cublasGemmAlgo_t /*algo*/) {
  using namespace welder_emu_cublas;
  if (handle == nullptr) return fail(CUBLAS_STATUS_NOT_INITIALIZED, "cublasGemmStridedBatchedEx on a null handle");
  if (alpha == nullptr || beta == nullptr) return fail(CUBLAS_STATUS_INVALID_VALUE, "alpha or beta is null");
  // With CUBLAS_COMPUTE_32F, alpha and beta are floats, read now (host pointer mode).
  const Gemm g{transa, transb, m, n, k, lda, ldb, ldc, strideA, strideB, strideC, batchCount,
               *static_cast<const float*>(alpha), *static_cast<const float*>(beta), A, B, C, Atype};
  if (const cublasStatus_t s = check_arguments(g, Btype, Ctype, computeType); s != CUBLAS_STATUS_SUCCESS) return s;
  if (const cublasStatus_t s = check_operands(g); s != CUBLAS_STATUS_SUCCESS) return s;
  const cudaError_t submitted = welder_emu_host::submit(handle->stream, [g]() {
    g.run();
    return cudaSuccess;
  });
  return submitted == cudaSuccess ? CUBLAS_STATUS_SUCCESS
                                  : fail(CUBLAS_STATUS_EXECUTION_FAILED, "the stream refused the work");
}
