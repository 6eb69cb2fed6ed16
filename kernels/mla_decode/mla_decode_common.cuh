// What the fused FP8 MLA decode's CUDA C++ split kernels (mla_decode_wgmma.cu, mla_decode_wgmma_tokens.cu: warpgroup
// MMA, sm_90a) share with their host side: the launch parameters (mirrored by kvwall.kernels.mla_decode.hopper's
// ctypes structure, whose size the library's kvwall_mla_params_size() checks at load), the item bounds of the plan's
// work list and small helpers. The kernels' shared device code is mla_decode_hopper.cuh.
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace kvwall_mla {

constexpr int DC = 512;     // latent (ckv) columns
constexpr int DR = 64;      // rope (kpe) columns
constexpr int D = DC + DR;  // 576 bytes per FP8 token row

struct Params {
  const __nv_bfloat16* qn;
  const __nv_bfloat16* qp;
  const uint8_t* ckv;
  const uint8_t* kpe;
  const void* indptr;
  const void* indices;
  const void* kvlen;
  const float* ckv_scale_ptr;
  const float* kpe_scale_ptr;
  float* part_o;
  float* part_lse;
  __nv_bfloat16* out;
  float* lse;
  const int* work;
  long long stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h;
  long long stride_ckv, stride_kpe, stride_o_b, stride_o_h;
  float ckv_scale_val, kpe_scale_val, qk_scale;  // qk_scale = sm_scale * log2(e)
  int H, num_indices, num_units, page;
  int indptr64, indices64, kvlen64, scale_from_ptr, write_lse;
  int q_vec;    // q_nope / q_pe rows start 16-byte aligned: 16-byte query loads
  int out_vec;  // out rows start 16-byte aligned: 16-byte output stores
  // Query tokens per request (1: decode; up to 8: MTP / EAGLE verify) and the heads of one token: the H rows of a
  // request are its q_len tokens' heads, token j = row / heads_per_token (the front door's fold).
  int q_len, heads_per_token;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four FP8 e4m3 values (one 32-bit word, byte 0 = lowest column) -> two float16x2 (bytes 0-1 and 2-3; low half =
// lower column), exact. The word is split into its 16-bit halves in PTX, so ptxas picks the half in the F2FP.
__device__ __forceinline__ void e4m3x4_to_f16x2x2(uint32_t word, uint32_t& lo, uint32_t& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(word));
}

__device__ __forceinline__ long long load_index(const void* p, long long i, int is64) {
  return is64 ? __ldg(static_cast<const long long*>(p) + i) : (long long)__ldg(static_cast<const int*>(p) + i);
}

__device__ __forceinline__ long long clampll(long long x, long long lo, long long hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// The tokens one plan item covers, clamped to the buffers exactly as the Triton kernel clamps them: the request's
// first index `start` in kv_indices, the request's `length` in tokens and the item's token range [lo, hi).
struct ItemBounds {
  int b, prow;
  long long start, length, lo, hi;
};

__device__ __forceinline__ ItemBounds item_bounds(const Params& p, int item) {
  const int* wrow = p.work + (long long)item * 4;
  ItemBounds r;
  r.b = wrow[0];
  r.prow = wrow[3];
  const long long item_lo = wrow[1], item_hi = wrow[2];
  r.start = clampll(load_index(p.indptr, r.b, p.indptr64), 0, p.num_indices);
  const long long stop = clampll(load_index(p.indptr, r.b + 1, p.indptr64), r.start, p.num_indices);
  long long length = stop - r.start;
  if (p.page != 1) length = clampll(load_index(p.kvlen, r.b, p.kvlen64), 0, (stop - r.start) * (long long)p.page);
  r.length = length;
  r.lo = clampll(item_lo, 0, length);
  r.hi = clampll(item_hi, r.lo, length);
  return r;
}

// The power of two each head's query is scaled by before rounding to float16, so that its largest |q| lands in
// [2^12, 2^15) (the Triton kernel's rule); `amax` is the head's largest |q|.
__device__ __forceinline__ int query_exponent(float amax) {
  float e2 = 0.f;
  if (amax > 0.f) e2 = 13.f - floorf(log2f(amax));
  return (int)fminf(fmaxf(e2, -120.f), 120.f);
}

}  // namespace kvwall_mla
