// What the two Hopper split kernels (mla_decode_wgmma.cu: heads on wgmma's M; mla_decode_wgmma_tokens.cu: a tile's
// tokens on M) share, so that neither repeats the other: the tile shape and its 128-byte-swizzled float16 layout,
// wgmma descriptors and fences, named barriers, the producer's gather of a tile's FP8 rows and their conversion, the
// query prologue, the causal limit of a multi-token query's rows (q_len > 1, the front door's fold), and the C
// entry plumbing (Params size, error strings, a launch with its shared-memory opt-in). Host side:
// kvwall.kernels.mla_decode.hopper.
#pragma once
#include "mla_decode_common.cuh"

namespace kvwall_mla {
namespace hopper {

constexpr int BN = 64;                // tokens per tile
constexpr int CHUNK = 64 * 128;       // 64 token rows x 64 float16 columns, 128-byte swizzled: 8 KB
constexpr int NCHUNK = D / 64;        // 9 column chunks per row (8 nope + 1 rope)
constexpr int TILE = NCHUNK * CHUNK;  // 73,728 B: a [64 x 576] float16 tile
constexpr float RESCALE = 8.f;        // lazy rescaling threshold (log2 units): P stays below 256
constexpr int ROWS = 2;               // token rows each producer thread gathers per tile (lr, lr + 32)
constexpr int PIECES = D / 64;        // 16-byte pieces per row per thread (a quad of lanes per row)
// The tile hand-over between a producer and a consumer (256 threads each): K_READY[b] (the producer arrives, the
// consumer waits: buffer b holds the next tile), K_FREE[b] (the consumer arrives, the producer waits).
enum TileBarrier { K_READY0 = 1, K_READY1 = 2, K_FREE0 = 3, K_FREE1 = 4 };

// Byte offset of 16-byte granule `gran` (8 float16 columns) of row `row` in a 128-byte-swizzled chunk.
__device__ __forceinline__ uint32_t swz(int row, int gran) { return row * 128 + ((gran ^ (row & 7)) << 4); }

// A wgmma shared-memory matrix descriptor, 128-byte swizzle: start address, leading and stride byte offsets.
__device__ __forceinline__ uint64_t gmma_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
         ((uint64_t)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Ordinary shared-memory stores that wgmma (the async proxy) reads next: each writing thread fences, then a barrier.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Named barriers: `sync` waits for N arrivals, `arrive` counts this thread towards 256 and goes on.
template <int N>
__device__ __forceinline__ void bar_sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(N) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }
// Keeps the compiler from moving reads or writes of accumulators across a wgmma issue or wait.
template <int N>
__device__ __forceinline__ void pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void pin(uint32_t (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

__device__ __forceinline__ uint32_t half2_bits(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// The latent and rope dequantization scales: from device memory (one float each) or from Params.
__device__ __forceinline__ float2 kv_scales(const Params& p) {
  return p.scale_from_ptr ? make_float2(__ldg(p.ckv_scale_ptr), __ldg(p.kpe_scale_ptr))
                          : make_float2(p.ckv_scale_val, p.kpe_scale_val);
}

// The tokens of this item's chunk (counted from its first, `lo`) that row `h` may see. A multi-token query (the
// front door's fold: H = q_len x heads_per_token rows, token j = h / heads_per_token) sees the first
// length - (q_len - 1 - j) tokens of its request (causal over the draft); may be <= 0 (nothing in this chunk).
__device__ __forceinline__ int row_tokens(const Params& p, const ItemBounds& ib, int h) {
  const long long end = ib.length - (p.q_len - 1 - h / p.heads_per_token);
  return (int)((end < ib.hi ? end : ib.hi) - ib.lo);
}

// The offset a row's logits take before exp2: its running maximum, or 0 while the row has seen no token (maximum
// still -inf), so that a row masked for a whole tile or chunk gets P = 0 and no NaN (FlashAttention's inf check).
__device__ __forceinline__ float exp2_base(float m) { return m == -INFINITY ? 0.f : m; }

// log2 of a power-of-two page size (the usual 1 and 64: pages split by shifts), else -1 (split by division).
__device__ __forceinline__ int page_shift_of(int page) { return (page & (page - 1)) == 0 ? __ffs(page) - 1 : -1; }

// The producer's side of a tile (the heads-on-M kernel's warpgroup 1, the tokens-on-M kernel's producers): gather a
// tile's FP8 rows into registers (16-byte loads, a tile ahead) and convert them into a swizzled float16 tile buffer
// (cvt.rn.f16x2.e4m3x2). Thread (row lr, quad lane lq) of the producer warpgroup holds pieces lq + 4k (k < 9) of
// token rows lr and lr + 32: k < 8 from ckv (latent columns 64k + 16 lq ..), k = 8 from kpe (rope columns 16 lq ..);
// piece k lands in column chunk k, granules 2 lq and 2 lq + 1. Rows past the chunk are zeros (their P is 0, and
// 0 x garbage may be NaN). `bad`: an out-of-range page-table entry was read (the chunk's output becomes NaN).
struct TileGather {
  const Params& p;
  long long start, lo, hi;
  int ntiles;
  int page_shift;
  int lr, lq;
  int bad;
  uint4 raw[ROWS][PIECES];
  // Page-table entries of the next tile to load, kept as the loaded words (low, high) until they are used: a
  // conversion right after the load (to 64 bits) would wait for it there. Loaded by volatile asm, so the loads
  // stay where they are written, a tile ahead of their use.
  int entry_lo[ROWS], entry_hi[ROWS];

  __device__ __forceinline__ TileGather(const Params& params, const ItemBounds& ib, int t)
      : p(params),
        start(ib.start),
        lo(ib.lo),
        hi(ib.hi),
        ntiles((int)((ib.hi - ib.lo + BN - 1) / BN)),
        page_shift(page_shift_of(params.page)),
        lr(t >> 2),
        lq(t & 3),
        bad(0) {}

  __device__ __forceinline__ void fetch_index(int tile) {
#pragma unroll
    for (int rr = 0; rr < ROWS; ++rr) {
      const long long tok = lo + (long long)tile * BN + lr + 32 * rr;
      entry_lo[rr] = entry_hi[rr] = 0;
      if (tile < ntiles && tok < hi) {
        const int tt = (int)tok;  // token positions are below 2^31
        const long long i = start + (page_shift >= 0 ? tt >> page_shift : tt / p.page);
        if (p.indices64)
          asm volatile("ld.global.nc.v2.s32 {%0, %1}, [%2];\n"
                       : "=r"(entry_lo[rr]), "=r"(entry_hi[rr])
                       : "l"(static_cast<const long long*>(p.indices) + i));
        else
          asm volatile("ld.global.nc.s32 %0, [%1];\n"
                       : "=r"(entry_lo[rr])
                       : "l"(static_cast<const int*>(p.indices) + i));
      }
    }
  }

  __device__ __forceinline__ void load_tile(int tile) {  // after fetch_index(tile)
#pragma unroll
    for (int rr = 0; rr < ROWS; ++rr) {
      const long long tok = lo + (long long)tile * BN + lr + 32 * rr;
      const bool live = tile < ntiles && tok < hi;
      long long e = p.indices64
                        ? (long long)(((unsigned long long)(unsigned)entry_hi[rr] << 32) | (unsigned)entry_lo[rr])
                        : (long long)entry_lo[rr];
      if (live && (e < 0 || e >= p.num_units)) {
        bad = 1;
        e = 0;
      }
      const int in_page = page_shift >= 0 ? (int)tok & (p.page - 1) : (int)tok % p.page;
      const long long slot = e * p.page + in_page;
      const uint4* src_c = reinterpret_cast<const uint4*>(p.ckv + slot * p.stride_ckv) + lq;
      const uint4* src_k = reinterpret_cast<const uint4*>(p.kpe + slot * p.stride_kpe) + lq;
#pragma unroll
      for (int k = 0; k < PIECES; ++k)
        raw[rr][k] = live ? __ldg(k < 8 ? src_c + 4 * k : src_k) : make_uint4(0, 0, 0, 0);
    }
  }

  // The registers' tile into buffer `buf` at `tiles` (two TILE-sized buffers), then K_READY[buf].
  __device__ __forceinline__ void convert_tile(uint8_t* tiles, int buf) {
    uint8_t* dst = tiles + buf * TILE;
#pragma unroll
    for (int rr = 0; rr < ROWS; ++rr) {
      const int row = lr + 32 * rr;
#pragma unroll
      for (int k = 0; k < PIECES; ++k) {
        uint32_t f[8];
        e4m3x4_to_f16x2x2(raw[rr][k].x, f[0], f[1]);
        e4m3x4_to_f16x2x2(raw[rr][k].y, f[2], f[3]);
        e4m3x4_to_f16x2x2(raw[rr][k].z, f[4], f[5]);
        e4m3x4_to_f16x2x2(raw[rr][k].w, f[6], f[7]);
        uint8_t* chunk = dst + k * CHUNK;
        *reinterpret_cast<uint4*>(chunk + swz(row, 2 * lq)) = make_uint4(f[0], f[1], f[2], f[3]);
        *reinterpret_cast<uint4*>(chunk + swz(row, 2 * lq + 1)) = make_uint4(f[4], f[5], f[6], f[7]);
      }
    }
    fence_async_smem();
    bar_arrive(buf ? K_READY1 : K_READY0);
  }
};

// The query prologue: row `r` of the CTA's query block (request b, row h of Params' H; zeros past H) to float16,
// scaled by 2^e so that its largest |q| lands in [2^12, 2^15), into the swizzled block at `q` (9 column chunks of
// `qchunk` bytes); LANES threads per row, this one taking 8-column groups part + LANES k. Part 0 writes the row's
// score scales of the nope and rope parts (the power of two undone, sm_scale * log2(e) and the dequantization
// scale applied) to row_c[r] and row_k[r].
template <int LANES>
__device__ __forceinline__ void query_prologue(const Params& p, int b, int h, int r, int part, uint8_t* q, int qchunk,
                                               float2 scales, float* row_c, float* row_k) {
  const __nv_bfloat16* qn = p.qn + (long long)b * p.stride_qn_b + (long long)h * p.stride_qn_h;
  const __nv_bfloat16* qp = p.qp + (long long)b * p.stride_qp_b + (long long)h * p.stride_qp_h;
  constexpr int PER = D / 8 / LANES;  // groups of 8 columns per thread
  uint4 qw[PER];
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int i0 = (part + LANES * k) * 8;
    if (h >= p.H) {
      qw[k] = make_uint4(0, 0, 0, 0);
    } else if (p.q_vec) {
      qw[k] = __ldg(reinterpret_cast<const uint4*>(i0 < DC ? qn + i0 : qp + (i0 - DC)));
    } else {
      uint32_t w[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const __nv_bfloat16* s = i0 < DC ? qn + i0 + 2 * e : qp + (i0 - DC) + 2 * e;
        w[e] = (uint32_t)__bfloat16_as_ushort(s[0]) | ((uint32_t)__bfloat16_as_ushort(s[1]) << 16);
      }
      qw[k] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
  float amax = 0.f;
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const uint32_t ws[4] = {qw[k].x, qw[k].y, qw[k].z, qw[k].w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ws[e]));
      amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
#pragma unroll
  for (int s = 1; s < LANES; s <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, s));
  const int e2 = query_exponent(amax);
  const float qmul = ldexpf(1.f, e2);
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int grp = part + LANES * k;  // columns 8 grp .. 8 grp + 7: chunk grp / 8, granule grp % 8
    const uint32_t ws[4] = {qw[k].x, qw[k].y, qw[k].z, qw[k].w};
    uint32_t hw[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ws[e]));
      hw[e] = half2_bits(f.x * qmul, f.y * qmul);
    }
    *reinterpret_cast<uint4*>(q + (grp >> 3) * qchunk + swz(r, grp & 7)) = make_uint4(hw[0], hw[1], hw[2], hw[3]);
  }
  if (part == 0) {
    row_c[r] = (scales.x * p.qk_scale) * ldexpf(1.f, -e2);
    row_k[r] = (scales.y * p.qk_scale) * ldexpf(1.f, -e2);
  }
}

// One launch of `kernel` (grid: head blocks x plan items) with its dynamic shared memory opted into; a CUDA error
// code (0: launched, or nothing to launch).
template <typename Kernel>
int launch(Kernel kernel, int head_blocks, int items, int threads, int smem, void* stream, const Params* p) {
  if (items == 0 || head_blocks == 0) return 0;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return (int)err;
  kernel<<<dim3(head_blocks, items), threads, smem, (cudaStream_t)stream>>>(*p);
  return (int)cudaGetLastError();
}

}  // namespace hopper
}  // namespace kvwall_mla

// The entry points every Hopper library has: the host checks its Params mirror's size against the first and reads
// launch errors through the second.
extern "C" {
int kvwall_mla_params_size() { return (int)sizeof(kvwall_mla::Params); }
const char* kvwall_mla_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }
}
