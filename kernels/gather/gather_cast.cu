// Gather-then-cast, CUDA C++ twin of kernels/gather/kernel.py (same contract, same tests).
//
//   out[i] = bf16(pool[kv_indices[i]] (* scale))   for i < min(capacity, kv_indptr[-1])
//
// pool: float8_e4m3fn pages of page_size rows of `dim` values (page_size 1: SGLang's token pool),
// pages `pool_page_stride` values apart (a row-strided view is fine: pool and out offsets are
// 64-bit); out: bfloat16, one page per index. The real row count is read on the device from
// kv_indptr's last entry (no host sync, CUDA-graph safe); out-of-range indices give NaN rows
// instead of reads outside the pool. Validation lives in the Python launcher
// (kernels/gather/cuda.py, kvwall.kernels.gather_cast_cuda).
//
// Only CUDA headers: the file compiles in seconds with plain nvcc (that is how CPU machines
// compile-check it), and torch.utils.cpp_extension.load builds it into a shared library that the
// launcher calls through a C ABI with the current stream.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // chunks in flight per thread

template <int VEC>
struct alignas(VEC) Bytes {
  uint8_t v[VEC];
};

template <int VEC>
struct alignas(2 * VEC) Bf16s {
  __nv_bfloat16 v[VEC];
};

__device__ __forceinline__ float2 fp8x2_to_float2(uint16_t pair) {
  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3);
  return __half22float2(*reinterpret_cast<__half2*>(&h));
}

__device__ __forceinline__ float fp8_to_float(uint8_t b) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
  return __half2float(*reinterpret_cast<__half*>(&h));
}

template <int VEC>
__device__ __forceinline__ void convert(const Bytes<VEC>& in, Bf16s<VEC>& out, bool scaled, float scale) {
  if constexpr (VEC == 1) {
    float f = fp8_to_float(in.v[0]);
    out.v[0] = __float2bfloat16_rn(scaled ? f * scale : f);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; k += 2) {
      float2 f = fp8x2_to_float2(static_cast<uint16_t>(in.v[k] | (in.v[k + 1] << 8)));
      if (scaled) {
        f.x *= scale;
        f.y *= scale;
      }
      *reinterpret_cast<__nv_bfloat162*>(&out.v[k]) = __floats2bfloat162_rn(f.x, f.y);
    }
  }
}

template <int VEC>
__global__ void __launch_bounds__(kThreads)
    gather_cast_kernel(const uint8_t* __restrict__ pool, const void* __restrict__ kv_indices, bool indices_64,
                       __nv_bfloat16* __restrict__ out, const void* __restrict__ indptr_end, bool indptr_64,
                       const float* __restrict__ scale_ptr, float scale_value, int scale_mode, uint32_t capacity_rows,
                       int64_t num_pages, int64_t pool_page_stride, int64_t out_page_stride, uint32_t page_size,
                       uint32_t dim) {
  const uint32_t chunks_per_row = dim / VEC;
  uint32_t rows = capacity_rows;
  if (indptr_end != nullptr) {
    int64_t end = indptr_64 ? *static_cast<const int64_t*>(indptr_end) : *static_cast<const int32_t*>(indptr_end);
    // Clamped to the capacity in pages BEFORE the multiply: an end near 2^57 times a page of 64 would wrap.
    const int64_t cap_pages = (static_cast<int64_t>(capacity_rows) + page_size - 1) / page_size;
    const int64_t pages = end < 0 ? 0 : (end < cap_pages ? end : cap_pages);
    const int64_t real = pages * static_cast<int64_t>(page_size);
    if (real < rows) rows = static_cast<uint32_t>(real);
  }
  const uint32_t total = rows * chunks_per_row;  // the launcher keeps capacity chunks < 2^31
  const bool scaled = scale_mode != 0;
  const float scale = scale_mode == 2 ? *scale_ptr : scale_value;
  const uint32_t stride = gridDim.x * blockDim.x;

  for (uint32_t base = blockIdx.x * blockDim.x + threadIdx.x; base < total; base += stride * kUnroll) {
    Bytes<VEC> in[kUnroll];
    int64_t dst[kUnroll];
    bool live[kUnroll], valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t chunk = base + u * stride;
      live[u] = chunk < total;
      valid[u] = false;
      if (!live[u]) continue;
      const uint32_t row = chunk / chunks_per_row;
      const uint32_t col = (chunk - row * chunks_per_row) * VEC;
      const uint32_t page = page_size == 1 ? row : row / page_size;
      const uint32_t within = row - page * page_size;
      const int64_t slot =
          indices_64 ? static_cast<const int64_t*>(kv_indices)[page] : static_cast<const int32_t*>(kv_indices)[page];
      valid[u] = slot >= 0 && slot < num_pages;
      const int64_t offset = static_cast<int64_t>(within) * dim + col;
      dst[u] = static_cast<int64_t>(page) * out_page_stride + offset;
      if (valid[u]) in[u] = *reinterpret_cast<const Bytes<VEC>*>(pool + slot * pool_page_stride + offset);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (!live[u]) continue;
      Bf16s<VEC> o;
      if (valid[u]) {
        convert<VEC>(in[u], o, scaled, scale);
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) o.v[k] = __float2bfloat16_rn(__int_as_float(0x7fc00000));
      }
      *reinterpret_cast<Bf16s<VEC>*>(out + dst[u]) = o;
    }
  }
}

template <int VEC>
cudaError_t launch(const uint8_t* pool, const void* kv_indices, bool indices_64, __nv_bfloat16* out,
                   const void* indptr_end, bool indptr_64, const float* scale_ptr, float scale_value, int scale_mode,
                   uint32_t capacity_rows, int64_t num_pages, int64_t pool_page_stride, int64_t out_page_stride,
                   uint32_t page_size, uint32_t dim, int max_blocks, cudaStream_t stream) {
  const uint64_t total = static_cast<uint64_t>(capacity_rows) * (dim / VEC);
  uint64_t blocks = (total + kThreads * kUnroll - 1) / (kThreads * kUnroll);
  if (blocks > static_cast<uint64_t>(max_blocks)) blocks = max_blocks;
  if (blocks == 0) return cudaSuccess;
  gather_cast_kernel<VEC><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      pool, kv_indices, indices_64, out, indptr_end, indptr_64, scale_ptr, scale_value, scale_mode, capacity_rows,
      num_pages, pool_page_stride, out_page_stride, page_size, dim);
  return cudaGetLastError();
}

}  // namespace

extern "C" {

// The widest vector (16, 8, 4, 2 or 1 values) that divides dim, both page strides and both base
// addresses; returns cudaErrorInvalidValue for a capacity whose chunks do not fit 31 bits.
int kvwall_gather_cast(const void* pool, const void* kv_indices, int indices_64, void* out, const void* indptr_end,
                       int indptr_64, const float* scale_ptr, float scale_value, int scale_mode, int64_t capacity_rows,
                       int64_t num_pages, int64_t pool_page_stride, int64_t out_page_stride, int64_t page_size,
                       int64_t dim, int max_blocks, void* stream) {
  if (capacity_rows < 0 || dim <= 0 || page_size <= 0 || capacity_rows * dim >= (int64_t{1} << 31))
    return static_cast<int>(cudaErrorInvalidValue);
  const uint8_t* p = static_cast<const uint8_t*>(pool);
  __nv_bfloat16* o = static_cast<__nv_bfloat16*>(out);
  const auto fits = [&](int vec) {
    return dim % vec == 0 && pool_page_stride % vec == 0 && out_page_stride % vec == 0 &&
           reinterpret_cast<uintptr_t>(p) % vec == 0 && reinterpret_cast<uintptr_t>(o) % (2 * vec) == 0;
  };
  const auto s = static_cast<cudaStream_t>(stream);
  const auto rows = static_cast<uint32_t>(capacity_rows);
  const auto ps = static_cast<uint32_t>(page_size);
  const auto d = static_cast<uint32_t>(dim);
#define KVWALL_LAUNCH(V)                                                                                               \
  return static_cast<int>(launch<V>(p, kv_indices, indices_64, o, indptr_end, indptr_64, scale_ptr, scale_value,       \
                                    scale_mode, rows, num_pages, pool_page_stride, out_page_stride, ps, d, max_blocks, \
                                    s))
  if (fits(16)) KVWALL_LAUNCH(16);
  if (fits(8)) KVWALL_LAUNCH(8);
  if (fits(4)) KVWALL_LAUNCH(4);
  if (fits(2)) KVWALL_LAUNCH(2);
  KVWALL_LAUNCH(1);
#undef KVWALL_LAUNCH
}

const char* kvwall_cuda_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"
