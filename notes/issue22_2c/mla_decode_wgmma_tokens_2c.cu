// EXPLORATION SOURCE (issue 22, not shipped, not imported by the library): the tokens-on-M wgmma kernel of
// kernels/mla_decode/mla_decode_wgmma_tokens.cu with TWO CONSUMER warpgroups on alternate tiles, built by
// notes/issue22_2c/wt2c_run.py with -D switches. Without -D flags it builds the shipped schedule (one consumer, two
// producers) for both instantiations; the 32-head instantiation is always the shipped schedule.
//
//   -DKVWALL_CONSUMERS16=2 -DKVWALL_PRODUCERS16=1   "2c1p": 384 threads; two consumers + ONE producer warpgroup that
//        keeps TWO tiles of FP8 rows in registers: its warp pairs 0-1 / 2-3 own buffer 0 / 1 (tiles of that parity,
//        4 rows a thread; K_READY / K_FREE count 128 + 64 = 192). setmaxnreg 152 / 152 / 200 (= 3 x 168, the 504
//        the launch holds). + -DKVWALL_SLOTS2=1: every producer thread holds both tiles instead (two register
//        slots); ptxas gives all its loads one scoreboard, so converting one slot waits for the other's loads.
//   -DKVWALL_CONSUMERS16=2 -DKVWALL_PRODUCERS16=2   "2c2p": 512 threads; two pipelines (consumer c + producer c own
//        buffer c and tiles c, c + 2, ...). Every warpgroup fits the launch's 128 registers (ptxas: 0 spills), so
//        no setmaxnreg by default; -DKVWALL_RC16=136 gives 136 / 136 / 120 / 120 (= 4 x 128).
//   -DKVWALL_RC16=N   the 16-head consumers' register count (the producers get what is left, a multiple of 8).
//   -DKVWALL_PF16=D   one-slot producers (2c2p, or the shipped schedule) also prefetch into L2 their own tile D
//        tiles past the one they load (per-thread prefetch.global.L2; "no gain" with one consumer in generation 6).
//   -DKVWALL_TRACE, -DKVWALL_ABLATE_LOADS / _CONVERT / _PV: as in /work/notes/issue22_explore (diagnostics).
//
// Fused FP8 MLA decode, split kernel for Hopper with warpgroup MMA and the TOKENS on the MMA's M side (sm_90a only),
// for few heads per GPU (16 or 32: DeepSeek / GLM at tensor parallelism 8 or 4). The host side is
// kvwall.kernels.mla_decode.wgmma_tokens; the same plan, numerics, partials and combine as the other paths.
//
// Why: mla_decode_wgmma.cu puts the heads on M (64 per CTA), so 16 heads compute as 64 -- 75 % of its tensor work is
// padding. Here one CTA runs one plan item for a block of HN heads (HN = 16 or 32, wgmma's N):
//   S^T [64 tokens x HN] = K [64 x 576] Q^T [576 x HN]        36 wgmma m64nHNk16, A = the converted K tile (K-major)
//   O^T [512 x HN]      += V^T [512 x 64] P^T [64 x HN]        32 wgmma m64nHNk16, A = the same tile read transposed
// so the tensor work is exactly the heads', and the FP8 tile is read from HBM once and converted once for all HN
// heads, into the 128-byte-swizzled float16 layout both products read (9 chunks of [64 tokens x 64 columns]).
// NC consumer warpgroups (0 .. NC - 1) do the math: the scores, the online softmax over the tokens (the M side: each
// warp holds 16 of the tile's tokens, so a head's maximum is exchanged between the four warps through shared memory,
// moved lazily as in the heads-on-M kernel), P^T in shared memory (the B operand) and the output product. With
// NC = 2, consumer c takes tiles c, c + 2, ... (buffer c) with its own m / l / O^T and P^T chunk; consumer 1's state
// is merged into consumer 0's through shared memory at the end (larger maximum, both rescaled), and consumer 0 writes.
// NP producer warpgroups gather the tiles' FP8 rows into registers (16-byte loads) and convert them into the two
// tile buffers (buffer = tile % 2). NP = 2: producer p owns buffer p and tiles p, p + 2, ... (one tile of loads in
// flight each). NP = 1 with NC = 2: the producer warpgroup's warp pairs play the two producers (see "2c1p").
// Named barriers: K_READY[b] (the producer of buffer b arrives, its consumer waits: b holds the next tile),
// K_FREE[b] (the consumer of buffer b arrives, the producer waits), 256 threads each (192 for 2c1p's warp pairs);
// CMAX0 + c and CP0 + c synchronize consumer c's four warps (128 threads).
#include "mla_decode_common.cuh"

namespace kvwall_mla {
namespace wt {

constexpr int BN = 64;                       // tokens per tile: wgmma's M
constexpr int CHUNK = 64 * 128;              // 64 token rows x 64 float16 columns, 128-byte swizzled: 8 KB
constexpr int NCHUNK = D / 64;               // 9 column chunks per row (8 nope + 1 rope)
constexpr int TILE = NCHUNK * CHUNK;         // 73,728 B: a [64 x 576] float16 tile
constexpr int K_OFF = 0;                     // two converted KV tiles
constexpr float RESCALE = 8.f;               // lazy rescaling threshold (log2 units): P stays below 256
constexpr int ROWS = 2;                      // token rows each producer thread gathers per tile (lr, lr + 32)
constexpr int PIECES = D / 64;               // 16-byte pieces per row per thread (a quad of lanes per row)
// K_READY / K_FREE pair a producer with a consumer (256 threads); CMAX0 + c and CP0 + c are consumer c's (128).
enum Barrier { K_READY0 = 1, K_READY1 = 2, K_FREE0 = 3, K_FREE1 = 4, CMAX0 = 5, CP0 = 7 };

// HN heads per CTA (wgmma's N); NC consumer warpgroups, then NP producer warpgroups.
template <int HN, int NC, int NP>
struct Layout {
  static constexpr int NT = 128 * (NC + NP);
  static constexpr int QCHUNK = HN * 128;              // HN head rows x 64 float16 columns, swizzled
  static constexpr int Q_OFF = 2 * TILE;                // the query block, [HN x 576] in 9 chunks
  static constexpr int P_OFF = Q_OFF + NCHUNK * QCHUNK; // P^T [HN heads x 64 tokens]: one chunk per consumer
  static constexpr int F_OFF = P_OFF + NC * QCHUNK;     // floats: per-warp maxima and sums, score scales, flags
  static constexpr int SMEM = F_OFF + (NC * 4 * HN + 4 * HN + 2 * HN) * 4 + 16;
};
#ifndef KVWALL_CONSUMERS16
#define KVWALL_CONSUMERS16 1
#endif
#ifndef KVWALL_PRODUCERS16
#define KVWALL_PRODUCERS16 2
#endif
// Warpgroups per instantiation (32 heads: its consumer's 128 accumulators leave registers for one consumer only).
template <int HN> constexpr int consumers() { return HN == 16 ? KVWALL_CONSUMERS16 : 1; }
template <int HN> constexpr int producers() { return HN == 16 ? KVWALL_PRODUCERS16 : 2; }
static_assert(Layout<16, 2, 2>::SMEM <= 232448 && Layout<32, 1, 2>::SMEM <= 232448, "shared memory per block");

// ---- Register budget (setmaxnreg). The launch gives each thread LAUNCH registers (65,536 / threads, down to a
// multiple of 8: 168 for 384 threads, 128 for 512); setmaxnreg moves them between warpgroups, and an increase beyond
// what the CTA holds waits forever (generation 6's hang). So NC x RC + NP x RP <= (NC + NP) x LAUNCH, every value a
// multiple of 8 in [24, 256]. The consumers' default: 240 (one consumer), 152 (two, 384 threads), 128 (two, 512
// threads: the launch's, no setmaxnreg).
#ifndef KVWALL_RC16
#define KVWALL_RC16 0
#endif
template <int HN, int NC, int NP>
struct Budget {
  static constexpr int NW = NC + NP;
  static constexpr int LAUNCH = (65536 / (128 * NW)) / 8 * 8 > 255 ? 255 : (65536 / (128 * NW)) / 8 * 8;
  static constexpr bool REBALANCE = NW > 2;
  static constexpr int RC_DEFAULT = NC == 1 ? 240 : (NW == 3 ? 152 : LAUNCH);
  static constexpr int RC = (HN == 16 && KVWALL_RC16 > 0) ? KVWALL_RC16 : RC_DEFAULT;
  static constexpr int RP_LEFT = ((NW * LAUNCH - NC * RC) / NP) / 8 * 8;
  static constexpr int RP = RP_LEFT > 256 ? 256 : RP_LEFT;
  // Whether the kernel executes setmaxnreg at all (NC = 1: REBALANCE; NC = 2: only where a value differs from the
  // launch's), so that the host checks an increase only where there is one.
  static constexpr bool SETS = NC == 1 ? REBALANCE : (RC != LAUNCH || RP != LAUNCH);
  static_assert(!REBALANCE || (RC % 8 == 0 && RC >= 24 && RC <= 256 && RP >= 24 && RP <= 256 &&
                               NC * RC + NP * RP <= NW * LAUNCH), "setmaxnreg budget beyond the launch's");
};

// ---- KVWALL_TRACE (diagnostic build only): lane 0 of each warpgroup's first warp sums clock64() deltas per phase.
#ifdef KVWALL_TRACE
__device__ unsigned long long g_trace[4][16];
#define TR(k)                                                              \
  if ((tid & 127) == 0) {                                                  \
    const unsigned long long now_ = clock64();                             \
    atomicAdd(&g_trace[wgi][k], now_ - tr_last);                           \
    tr_last = now_;                                                        \
  }
#else
#define TR(k)
#endif

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
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
template <int N = 256>
__device__ __forceinline__ void bar_arrive(int id) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(N) : "memory"); }
template <int N>
__device__ __forceinline__ void pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ uint32_t half2_bits(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// D[64 x HN] (+)= A[64 x 16] B[16 x HN], float16 in, float32 accumulators (warp w of the warpgroup: rows 16 w +
// lane / 4 (+ 8), columns 8 j + 2 (lane % 4) (+ 1) in d[4 j .. 4 j + 3]). Both operands from shared memory by
// descriptor; B K-major; A K-major (TRANS_A = 0) or MN-major (1: a 16-bit type may be read transposed).
template <int TRANS_A>
__device__ __forceinline__ void wgmma_n16(float (&d)[8], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1, %11, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(a), "l"(b), "r"(accumulate), "n"(TRANS_A));
}
template <int TRANS_A>
__device__ __forceinline__ void wgmma_n32(float (&d)[16], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15},"
      " %16, %17, p, 1, 1, %19, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b), "r"(accumulate), "n"(TRANS_A));
}
template <int HN, int TRANS_A>
__device__ __forceinline__ void wgmma_hn(float (&d)[HN / 2], uint64_t a, uint64_t b, int accumulate) {
  if constexpr (HN == 16)
    wgmma_n16<TRANS_A>(d, a, b, accumulate);
  else
    wgmma_n32<TRANS_A>(d, a, b, accumulate);
}


template <int HN, int NC, int NP>
__global__ void __launch_bounds__(Layout<HN, NC, NP>::NT, 1) mla_wgmma_tokens_kernel(const Params p) {
  using L = Layout<HN, NC, NP>;
  using RB = Budget<HN, NC, NP>;
  static_assert(NC == 1 || NC == 2, "one or two consumers");
  static_assert(NP == 1 || NP == 2, "one or two producers");
  // Two consumers: consumer c owns buffer c = tile % 2, so a producer's tiles must keep to its buffer(s).
  // NC = 2, NP = 1: the producer warpgroup keeps two tiles of loads in flight. SPLIT (default): its warp pairs 0-1
  // and 2-3 are two producers of 64 threads (pair s: buffer s, tiles s, s + 2, ...; 4 rows a thread), so each warp
  // holds ONE tile of loads. TWO_SLOTS (-DKVWALL_SLOTS2): every thread holds two tiles (slots), which ptxas
  // compiles with one scoreboard for both slots' loads: converting a tile waits for the other slot's loads too.
#ifndef KVWALL_SLOTS2
#define KVWALL_SLOTS2 0
#endif
  constexpr bool TWO_SLOTS = NC == 2 && NP == 1 && KVWALL_SLOTS2;
  constexpr bool SPLIT = NC == 2 && NP == 1 && !KVWALL_SLOTS2;
  constexpr int KN = SPLIT ? 192 : 256;        // threads on K_READY / K_FREE: a consumer + its producer
  constexpr int PSTEP = SPLIT ? 2 : NP;        // tiles between a producer's tiles
  constexpr int NV = HN / 2;   // accumulator floats per thread of one m64nHN product
  constexpr int NCOL = HN / 4; // distinct head columns per thread: 8 j + 2 c + {0, 1}, j < HN / 8
  extern __shared__ __align__(1024) uint8_t smem[];
  float* s_max0 = reinterpret_cast<float*>(smem + L::F_OFF); // [NC][4 warps][HN]: each warp's tile maximum per head
  float* s_sum = s_max0 + NC * 4 * HN;                        // [4 warps][HN]: each warp's row sums, at the end
  float* row_c = s_sum + 4 * HN;                              // per head: score scale of the nope part
  float* row_k = row_c + HN;                                  // and of the rope part
  int* s_bad = reinterpret_cast<int*>(row_k + HN);            // an out-of-range index was seen
  int* s_flag0 = s_bad + 1;                                   // per consumer: the last tile whose maximum moved
  const uint32_t base = smem_addr(smem);
  if (base & 1023) __trap();  // the swizzle needs 1024-byte aligned chunks

  const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, c = lane & 3;
  const int wgi = __shfl_sync(0xffffffffu, tid >> 7, 0);  // warp-uniform, so descriptors stay uniform
  const int h0 = blockIdx.x * HN;
#ifdef KVWALL_TRACE
  unsigned long long tr_last = clock64();
#endif
  const ItemBounds ib = item_bounds(p, blockIdx.y);
  const long long start = ib.start, lo = ib.lo, hi = ib.hi;
  const float ckv_scale = p.scale_from_ptr ? __ldg(p.ckv_scale_ptr) : p.ckv_scale_val;
  const float kpe_scale = p.scale_from_ptr ? __ldg(p.kpe_scale_ptr) : p.kpe_scale_val;
  const int ntiles = (int)((hi - lo + BN - 1) / BN);
  const int page_shift = (p.page & (p.page - 1)) == 0 ? __ffs(p.page) - 1 : -1;

  // ---- The producers' gather and conversion (the heads-on-M kernel's producer), on a register slot.
  int bad = 0;
  // Producer pw's thread t gathers rows lr + (64 / R) rr (rr < R: 2 rows, or 4 for a SPLIT pair's 64 threads); the
  // lanes of a quad share a row (16-byte pieces lq + 4 k).
  const int pw = wgi - NC, t = tid & 127, lr = (SPLIT ? (t & 63) : t) >> 2, lq = t & 3;
  const int prod = SPLIT ? warp >> 1 : pw;  // the producer (buffer) this thread's warp works for
  auto fetch_index = [&](int tile, auto& entry_lo, auto& entry_hi) {
    constexpr int R = sizeof(entry_lo) / sizeof(entry_lo[0]);
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
      const long long tok = lo + (long long)tile * BN + lr + (BN / R) * rr;
      entry_lo[rr] = entry_hi[rr] = 0;
      if (tile < ntiles && tok < hi) {
        const int tt = (int)tok;
        const long long i = start + (page_shift >= 0 ? tt >> page_shift : tt / p.page);
        if (p.indices64)
          asm volatile("ld.global.nc.v2.s32 {%0, %1}, [%2];\n"
                       : "=r"(entry_lo[rr]), "=r"(entry_hi[rr]) : "l"(static_cast<const long long*>(p.indices) + i));
        else
          asm volatile("ld.global.nc.s32 %0, [%1];\n" : "=r"(entry_lo[rr]) : "l"(static_cast<const int*>(p.indices) + i));
      }
    }
  };
  auto load_tile = [&](int tile, auto& raw, const auto& entry_lo, const auto& entry_hi) {  // after fetch_index(tile)
    constexpr int R = sizeof(entry_lo) / sizeof(entry_lo[0]);
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
      const long long tok = lo + (long long)tile * BN + lr + (BN / R) * rr;
      const bool live = tile < ntiles && tok < hi;
      long long e = p.indices64 ? (long long)(((unsigned long long)(unsigned)entry_hi[rr] << 32) | (unsigned)entry_lo[rr])
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
#ifdef KVWALL_ABLATE_LOADS
        raw[rr][k] = make_uint4(0x30303030u ^ (unsigned)slot, 0x31313131u, 0x32323232u, 0x33333333u);
#else
        raw[rr][k] = live ? __ldg(k < 8 ? src_c + 4 * k : src_k) : make_uint4(0, 0, 0, 0);
#endif
    }
  };
  auto convert_tile = [&](int buf, const auto& raw) {
    constexpr int R = sizeof(raw) / sizeof(raw[0]);
    uint8_t* dst = smem + K_OFF + buf * TILE;
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
      const int row = lr + (BN / R) * rr;
#pragma unroll
      for (int k = 0; k < PIECES; ++k) {
        uint32_t f[8];
#ifdef KVWALL_ABLATE_CONVERT
        f[0] = f[4] = raw[rr][k].x & 0x3f3f3f3f; f[1] = f[5] = raw[rr][k].y & 0x3f3f3f3f;
        f[2] = f[6] = raw[rr][k].z & 0x3f3f3f3f; f[3] = f[7] = raw[rr][k].w & 0x3f3f3f3f;
#else
        e4m3x4_to_f16x2x2(raw[rr][k].x, f[0], f[1]);
        e4m3x4_to_f16x2x2(raw[rr][k].y, f[2], f[3]);
        e4m3x4_to_f16x2x2(raw[rr][k].z, f[4], f[5]);
        e4m3x4_to_f16x2x2(raw[rr][k].w, f[6], f[7]);
#endif
        uint8_t* chunk = dst + k * CHUNK;
        *reinterpret_cast<uint4*>(chunk + swz(row, 2 * lq)) = make_uint4(f[0], f[1], f[2], f[3]);
        *reinterpret_cast<uint4*>(chunk + swz(row, 2 * lq + 1)) = make_uint4(f[4], f[5], f[6], f[7]);
      }
    }
    fence_async_smem();
    bar_arrive<KN>(buf ? K_READY1 : K_READY0);
  };

  // ---- Queries -> float16, each head scaled by 2^e (largest |q| in [2^12, 2^15)), into the swizzled Q block
  // [HN rows x 576]: eight threads per head (tid < 8 HN, consumer 0's threads for 16 heads), 8-column groups
  // part + 8 k (k < 9); and the shared flags.
  auto convert_query = [&]() {
    if (tid < 8 * HN) {
      const int r = tid >> 3, part = tid & 7, h = h0 + r;
      const __nv_bfloat16* qn = p.qn + (long long)ib.b * p.stride_qn_b + (long long)h * p.stride_qn_h;
      const __nv_bfloat16* qp = p.qp + (long long)ib.b * p.stride_qp_b + (long long)h * p.stride_qp_h;
      constexpr int PER = D / 8 / 8;  // 9 groups of 8 columns per thread
      uint4 qw[PER];
#pragma unroll
      for (int k = 0; k < PER; ++k) {
        const int i0 = (part + 8 * k) * 8;
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
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
      const int e2 = query_exponent(amax);
      const float qmul = ldexpf(1.f, e2);
#pragma unroll
      for (int k = 0; k < PER; ++k) {
        const int grp = part + 8 * k;  // columns 8 grp .. 8 grp + 7: chunk grp / 8, granule grp % 8 = part
        const uint32_t ws[4] = {qw[k].x, qw[k].y, qw[k].z, qw[k].w};
        uint32_t hw[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ws[e]));
          hw[e] = half2_bits(f.x * qmul, f.y * qmul);
        }
        *reinterpret_cast<uint4*>(smem + L::Q_OFF + (grp >> 3) * L::QCHUNK + swz(r, grp & 7)) =
            make_uint4(hw[0], hw[1], hw[2], hw[3]);
      }
      if (part == 0) {
        row_c[r] = (ckv_scale * p.qk_scale) * ldexpf(1.f, -e2);
        row_k[r] = (kpe_scale * p.qk_scale) * ldexpf(1.f, -e2);
      }
    }
    if (tid == 0) {
      *s_bad = 0;
      s_flag0[0] = s_flag0[1] = -1;
    }
    fence_async_smem();
  };

  auto head_of = [&](int ci) { return 8 * (ci >> 1) + 2 * c + (ci & 1); };
  auto col_of = [](int i) { return 2 * (i >> 2) + (i & 1); };  // accumulator index -> column index

  // ================= producer pw, one register slot: tiles pw, pw + NP, ... (buffer tile % 2) =================
  // Barrier protocol: tile tl's conversion waits for K_FREE[tl % 2] iff tl >= 2 (the consumer's release of tile
  // tl - 2, which it gives iff (tl - 2) + 2 < ntiles), then arrives on K_READY[tl % 2] (the consumer waits once per
  // tile). A producer never arrives twice on K_READY[b] without a K_FREE[b] wait between (nor the consumer on
  // K_FREE[b] without a K_READY[b] wait), so arrivals cannot pile up on a barrier.
  // KVWALL_PF16 = D > 0 (16-head instantiation, one-slot producers only): each producer also prefetches its own tile
  // D tiles past the one it loads into registers into L2 (prefetch.global.L2: no registers held, no shared memory;
  // its page-table entries fetched an iteration earlier), so that the register loads hit L2.
#ifndef KVWALL_PF16
#define KVWALL_PF16 0
#endif
  constexpr int PF = HN == 16 ? KVWALL_PF16 : 0;
  constexpr int PROWS = SPLIT ? 2 * ROWS : ROWS;  // rows a producer thread gathers per tile
  int pf_lo[PROWS], pf_hi[PROWS];
  auto prefetch_tile = [&](int tile) {  // after fetch_index(tile, pf_lo, pf_hi): a row's quad covers its 576 bytes
#pragma unroll
    for (int rr = 0; rr < PROWS; ++rr) {
      const long long tok = lo + (long long)tile * BN + lr + (BN / PROWS) * rr;
      if (!(tile < ntiles && tok < hi)) continue;
      const long long e = p.indices64 ? (long long)(((unsigned long long)(unsigned)pf_hi[rr] << 32) | (unsigned)pf_lo[rr])
                                      : (long long)pf_lo[rr];
      if (e < 0 || e >= p.num_units) continue;
      const int in_page = page_shift >= 0 ? (int)tok & (p.page - 1) : (int)tok % p.page;
      const long long slot = e * p.page + in_page;
      const uint8_t* row = p.ckv + slot * p.stride_ckv;
      asm volatile("prefetch.global.L2 [%0];\n" ::"l"(row + 128 * lq) : "memory");
      if (lq == 0) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p.kpe + slot * p.stride_kpe) : "memory");
      if (lq == 1) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(row + DC - 1) : "memory");
    }
  };
  auto produce_one_slot = [&](auto& raw, auto& entry_lo, auto& entry_hi) {  // producer `prod`: tiles prod + k PSTEP
    if constexpr (PF > 0) fetch_index(prod + PSTEP * (1 + PF), pf_lo, pf_hi);
    for (int tl = prod; tl < ntiles; tl += PSTEP) {
      const int buf = tl & 1;
      if (tl >= 2) bar_sync(buf ? K_FREE1 : K_FREE0, KN);  // the consumer is done with tile tl - 2 in buffer buf
      TR(7);
      convert_tile(buf, raw);                                // raw holds tile tl
      TR(8);
      if (tl + PSTEP < ntiles) {
        load_tile(tl + PSTEP, raw, entry_lo, entry_hi);
        fetch_index(tl + 2 * PSTEP, entry_lo, entry_hi);
        if constexpr (PF > 0) {
          prefetch_tile(tl + PSTEP * (1 + PF));
          fetch_index(tl + PSTEP * (2 + PF), pf_lo, pf_hi);
        }
        TR(9);
      }
    }
  };

  // ============ consumer wgi: tiles wgi, wgi + NC, ... (buffer it % 2): scores, softmax, O^T += V^T P^T ============
  auto consume = [&]() {
    float* s_max = s_max0 + wgi * 4 * HN;
    int* s_flag = s_flag0 + wgi;
    // This consumer's accumulators: O^T in 8 blocks of 64 latent columns, [64 columns x HN heads] each.
    float o[8][NV];
#pragma unroll
    for (int b = 0; b < 8; ++b)
#pragma unroll
      for (int i = 0; i < NV; ++i) o[b][i] = 0.f;
    // Per head column of this thread (column index ci = 2 j + (e & 1) <-> head 8 j + 2 c + (e & 1)): the reference
    // maximum (base 2) and this thread's share of the row sum.
    float m_i[NCOL], l_i[NCOL];
#pragma unroll
    for (int ci = 0; ci < NCOL; ++ci) {
      m_i[ci] = -INFINITY;
      l_i[ci] = 0.f;
    }
    float rc[NCOL], rk[NCOL];
#pragma unroll
    for (int ci = 0; ci < NCOL; ++ci) {
      rc[ci] = row_c[head_of(ci)];
      rk[ci] = row_k[head_of(ci)];
    }
    const uint64_t qb0 = gmma_desc(base + L::Q_OFF, 16, 1024);
    const uint64_t pb0 = gmma_desc(base + L::P_OFF + wgi * L::QCHUNK, 16, 1024);
    const int t0 = 16 * warp + g;  // this thread's token rows: t0 and t0 + 8
    for (int it = wgi; it < ntiles; it += NC) {
      const uint32_t kbuf = base + K_OFF + (it & 1) * TILE;
      bar_sync((it & 1) ? K_READY1 : K_READY0, KN);
      TR(1);
      float sn[NV], sr[NV];
      const uint64_t ka0 = gmma_desc(kbuf, 16, 1024);
      wg_fence();
#pragma unroll
      for (int kc = 0; kc < NCHUNK; ++kc) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint32_t a_step = (kc * CHUNK + kk * 32) >> 4, b_step = (kc * L::QCHUNK + kk * 32) >> 4;
          if (kc < 8)
            wgmma_hn<HN, 0>(sn, ka0 + a_step, qb0 + b_step, kc + kk > 0);
          else
            wgmma_hn<HN, 0>(sr, ka0 + a_step, qb0 + b_step, kk > 0);
        }
      }
      wg_commit();
      wg_wait0();
      TR(2);
      pin(sn);
      pin(sr);

      // Logits (base 2), masked past the chunk. Lazy rescaling: the reference maximum m_i moves only when a logit
      // exceeds it by more than RESCALE (log2 units: P <= 2^RESCALE is exact enough in float16 and in float32
      // sums). So P = 2^(x - m_i) is computed at once, and the four warps exchange their maxima only when some
      // warp saw a logit above m_i + RESCALE (the first tile always; later rarely): that warp stamps s_flag with
      // the tile, read by all after the P barrier. (No warp can stamp the next tile before all have read this
      // one's: that needs this tile's P V, which waits for every warp's issue.)
      const int live = (int)min((long long)BN, hi - (lo + (long long)it * BN));
      bool over = false;
      float lt[NCOL];
#pragma unroll
      for (int ci = 0; ci < NCOL; ++ci) lt[ci] = 0.f;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int ci = col_of(i), tok = t0 + ((i & 2) ? 8 : 0);
        float x = sn[i] * rc[ci] + sr[i] * rk[ci];
        if (tok >= live) x = -INFINITY;
        sn[i] = x;
        over |= x > m_i[ci] + RESCALE;
      }
      if (__any_sync(0xffffffffu, over) && lane == 0) *reinterpret_cast<volatile int*>(s_flag) = it;
      // P^T [head][token] in float16 into this consumer's swizzled P chunk (row = head, 128 B = 64 tokens).
      auto write_p = [&](float (&sums)[NCOL]) {
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          const int ci = col_of(i), tok = t0 + ((i & 2) ? 8 : 0);
          const float pv = exp2f(sn[i] - m_i[ci]);
          sums[ci] += pv;
          *reinterpret_cast<__half*>(smem + L::P_OFF + wgi * L::QCHUNK + swz(head_of(ci), tok >> 3) + 2 * (tok & 7)) =
              __float2half_rn(pv);
        }
        fence_async_smem();
        bar_sync(CP0 + wgi, 128);
      };
      write_p(lt);
      TR(3);
      if (*reinterpret_cast<volatile int*>(s_flag) == it) {
        // Some logit passed m_i + RESCALE: the tile's maximum per head over the four warps, m_i moved, P again.
        float mx[NCOL];
#pragma unroll
        for (int ci = 0; ci < NCOL; ++ci) mx[ci] = -INFINITY;
#pragma unroll
        for (int i = 0; i < NV; ++i) mx[col_of(i)] = fmaxf(mx[col_of(i)], sn[i]);
#pragma unroll
        for (int ci = 0; ci < NCOL; ++ci) {
          mx[ci] = fmaxf(mx[ci], __shfl_xor_sync(0xffffffffu, mx[ci], 4));
          mx[ci] = fmaxf(mx[ci], __shfl_xor_sync(0xffffffffu, mx[ci], 8));
          mx[ci] = fmaxf(mx[ci], __shfl_xor_sync(0xffffffffu, mx[ci], 16));
        }
        if (g == 0) {
#pragma unroll
          for (int ci = 0; ci < NCOL; ++ci) s_max[warp * HN + head_of(ci)] = mx[ci];
        }
        bar_sync(CMAX0 + wgi, 128);
        float alpha[NCOL];
#pragma unroll
        for (int ci = 0; ci < NCOL; ++ci) {
          const int h = head_of(ci);
          const float tm = fmaxf(fmaxf(s_max[h], s_max[HN + h]), fmaxf(s_max[2 * HN + h], s_max[3 * HN + h]));
          const float m = tm > m_i[ci] + RESCALE ? tm : m_i[ci];
          alpha[ci] = exp2f(m_i[ci] - m);
          m_i[ci] = m;
          l_i[ci] *= alpha[ci];
          lt[ci] = 0.f;
        }
        write_p(lt);
#pragma unroll
        for (int b = 0; b < 8; ++b)
#pragma unroll
          for (int i = 0; i < NV; ++i) o[b][i] *= alpha[col_of(i)];
      }
#pragma unroll
      for (int ci = 0; ci < NCOL; ++ci) l_i[ci] += lt[ci];
      TR(4);
#pragma unroll
      for (int b = 0; b < 8; ++b) pin(o[b]);
      wg_fence();
#ifndef KVWALL_ABLATE_PV
#pragma unroll
      for (int b = 0; b < 8; ++b) {
        // A = V^T for latent columns 64 b .. 64 b + 63: chunk b read MN-major (LBO: the next chunk, SBO: 8 token
        // rows); k-step ks = tokens 16 ks .. 16 ks + 15, 2048 bytes further. B = P^T, k-step 32 bytes further.
        const uint64_t va = gmma_desc(kbuf + b * CHUNK, CHUNK, 1024);
#pragma unroll
        for (int ks = 0; ks < BN / 16; ++ks) wgmma_hn<HN, 1>(o[b], va + ((ks * 2048) >> 4), pb0 + ((ks * 32) >> 4), 1);
      }
#endif
      wg_commit();
      wg_wait0();
      TR(5);
#pragma unroll
      for (int b = 0; b < 8; ++b) pin(o[b]);
      if (it + 2 < ntiles) bar_arrive<KN>((it & 1) ? K_FREE1 : K_FREE0);
      TR(6);
    }
    __syncthreads();  // (2) every tile consumed; the producers' `bad` is in shared memory
    if constexpr (NC == 2) {
      // Consumer 1's state (per thread: the maxima, its share of the sums, O^T) through the free tile buffers to
      // consumer 0, whose thread of the same index holds the same heads and rows: merged with the larger maximum
      // (the combine's rule; a consumer without a tile has m = -inf, l = 0, O = 0 and gets the factor 0).
      float* s_x = reinterpret_cast<float*>(smem + K_OFF);
      const int tt = tid & 127;
      if (wgi == 1) {
#pragma unroll
        for (int ci = 0; ci < NCOL; ++ci) {
          s_x[ci * 128 + tt] = m_i[ci];
          s_x[(NCOL + ci) * 128 + tt] = l_i[ci];
        }
#pragma unroll
        for (int b = 0; b < 8; ++b)
#pragma unroll
          for (int i = 0; i < NV; ++i) s_x[(2 * NCOL + b * NV + i) * 128 + tt] = o[b][i];
      }
      __syncthreads();  // (3) consumer 1's state is in shared memory
      if (wgi == 1) return;
      float f0[NCOL], f1[NCOL];
#pragma unroll
      for (int ci = 0; ci < NCOL; ++ci) {
        const float m1 = s_x[ci * 128 + tt], m = fmaxf(m_i[ci], m1);
        f0[ci] = m == -INFINITY ? 0.f : exp2f(m_i[ci] - m);
        f1[ci] = m == -INFINITY ? 0.f : exp2f(m1 - m);
        l_i[ci] = l_i[ci] * f0[ci] + s_x[(NCOL + ci) * 128 + tt] * f1[ci];
        m_i[ci] = m;
      }
#pragma unroll
      for (int b = 0; b < 8; ++b)
#pragma unroll
        for (int i = 0; i < NV; ++i)
          o[b][i] = o[b][i] * f0[col_of(i)] + s_x[(2 * NCOL + b * NV + i) * 128 + tt] * f1[col_of(i)];
    }
    // ---- Row sums over the eight token lanes of each column, then over the four warps; normalize and
    // write; NaN for a chunk that held an out-of-range index.
#pragma unroll
    for (int ci = 0; ci < NCOL; ++ci) {
      l_i[ci] += __shfl_xor_sync(0xffffffffu, l_i[ci], 4);
      l_i[ci] += __shfl_xor_sync(0xffffffffu, l_i[ci], 8);
      l_i[ci] += __shfl_xor_sync(0xffffffffu, l_i[ci], 16);
    }
    if (g == 0) {
#pragma unroll
      for (int ci = 0; ci < NCOL; ++ci) s_sum[warp * HN + head_of(ci)] = l_i[ci];
    }
    bar_sync(CMAX0, 128);  // consumer 0 alone
    const int any_bad = *s_bad;
#pragma unroll
    for (int ci = 0; ci < NCOL; ++ci) {
      const int hl = head_of(ci), h = h0 + hl;
      float l = s_sum[hl] + s_sum[HN + hl] + s_sum[2 * HN + hl] + s_sum[3 * HN + hl];
      if (any_bad) l = NAN;
      const bool empty = l == 0.f;
      const float norm = empty ? 0.f : ckv_scale / l;
      const float lse2 = empty ? -INFINITY : m_i[ci] + log2f(l);
      if (h >= p.H) continue;
      // This thread holds O^T rows (latent columns) 64 b + 16 w + g (+ 8) of head h: accumulator index i with
      // col_of(i) == ci, i.e. i = 4 (ci / 2) + (ci % 2) (+ 2 for the row 8 further).
      const int i0 = 4 * (ci >> 1) + (ci & 1);
      if (ib.prow < 0) {
        __nv_bfloat16* orow = p.out + (long long)ib.b * p.stride_o_b + (long long)h * p.stride_o_h;
#pragma unroll
        for (int b = 0; b < 8; ++b) {
          orow[64 * b + 16 * warp + g] = __float2bfloat16_rn(o[b][i0] * norm);
          orow[64 * b + 16 * warp + g + 8] = __float2bfloat16_rn(o[b][i0 + 2] * norm);
        }
        if (p.write_lse && warp == 0 && g == 0) p.lse[(long long)ib.b * p.H + h] = lse2 * 0.6931471805599453f;
      } else {
        float* prow_o = p.part_o + ((long long)ib.prow * p.H + h) * DC;
#pragma unroll
        for (int b = 0; b < 8; ++b) {
          prow_o[64 * b + 16 * warp + g] = o[b][i0] * norm;
          prow_o[64 * b + 16 * warp + g + 8] = o[b][i0 + 2] * norm;
        }
        if (warp == 0 && g == 0) p.part_lse[(long long)ib.prow * p.H + h] = lse2;
      }
    }
  };

  // Barrier 0 (__syncthreads, every thread of the CTA, reached from either role's code): (1) the query and flags
  // are in shared memory; (2) every tile consumed (the consumers after their loops, the producers after theirs);
  // with two consumers (3) consumer 1's state is in shared memory. Each role passes each of them exactly once.
  if constexpr (NC == 1) {
    // ---- The shipped schedule: the producers' first loads before the query conversion, one register budget.
    uint4 raw[ROWS][PIECES];
    int entry_lo[ROWS], entry_hi[ROWS];
    if (wgi >= NC) {
      fetch_index(pw, entry_lo, entry_hi);
      load_tile(pw, raw, entry_lo, entry_hi);
      fetch_index(pw + NP, entry_lo, entry_hi);
    }
    convert_query();
    __syncthreads();  // (1)
    if (wgi >= NC) {
      if constexpr (RB::REBALANCE) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(RB::RP) : "memory");
      produce_one_slot(raw, entry_lo, entry_hi);
      if (bad) atomicOr(s_bad, 1);
      __syncthreads();  // (2)
      return;
    }
    if constexpr (RB::REBALANCE) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(RB::RC) : "memory");
    consume();
  } else {
    // ---- Two consumers: the roles part before the query conversion, so that no register of the producers' first
    // loads is live in code that runs at the launch's budget (the common prologue holds little). setmaxnreg first
    // in each role: the decreasing side never waits, the increasing side waits for the decreases (both sides start
    // with it, so no deadlock), and NC x RC + NP x RP <= the launch's (Budget's static_assert).
    if (wgi >= NC) {
      if constexpr (RB::RP < RB::LAUNCH) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(RB::RP) : "memory");
      if constexpr (RB::RP > RB::LAUNCH) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(RB::RP) : "memory");
      if constexpr (TWO_SLOTS) {
        // ================= the producer: every tile, two register slots (slot = buffer = tile % 2) =================
        // Tile tl is loaded into slot tl % 2 two tiles ahead: after converting tile tl, the slot takes tile tl + 2
        // (its page-table entries fetched a slot-round earlier), so tiles tl + 1 and tl + 2 are in flight while
        // the consumers work on tiles tl - 1 and tl. Same K_FREE / K_READY rule per buffer as produce_one_slot.
        uint4 raw0[ROWS][PIECES], raw1[ROWS][PIECES];
        int elo0[ROWS], ehi0[ROWS], elo1[ROWS], ehi1[ROWS];
        fetch_index(0, elo0, ehi0);
        fetch_index(1, elo1, ehi1);
        load_tile(0, raw0, elo0, ehi0);
        fetch_index(2, elo0, ehi0);
        load_tile(1, raw1, elo1, ehi1);
        fetch_index(3, elo1, ehi1);
        __syncthreads();  // (1)
        for (int tl = 0; tl < ntiles; tl += 2) {
          if (tl >= 2) bar_sync(K_FREE0, 256);  // consumer 0 is done with tile tl - 2
          TR(7);
          convert_tile(0, raw0);
          TR(8);
          if (tl + 2 < ntiles) {
            load_tile(tl + 2, raw0, elo0, ehi0);
            fetch_index(tl + 4, elo0, ehi0);
          }
          TR(9);
          if (tl + 1 < ntiles) {
            if (tl + 1 >= 2) bar_sync(K_FREE1, 256);  // consumer 1 is done with tile tl - 1
            TR(7);
            convert_tile(1, raw1);
            TR(8);
            if (tl + 3 < ntiles) {
              load_tile(tl + 3, raw1, elo1, ehi1);
              fetch_index(tl + 5, elo1, ehi1);
            }
            TR(9);
          }
        }
      } else {
        // One slot per producer: 2c2p's producer warpgroups, or SPLIT's warp pairs (4 rows a thread).
        uint4 raw[PROWS][PIECES];
        int entry_lo[PROWS], entry_hi[PROWS];
        fetch_index(prod, entry_lo, entry_hi);
        load_tile(prod, raw, entry_lo, entry_hi);
        fetch_index(prod + PSTEP, entry_lo, entry_hi);
        __syncthreads();  // (1)
        produce_one_slot(raw, entry_lo, entry_hi);
      }
      if (bad) atomicOr(s_bad, 1);
      __syncthreads();  // (2)
      __syncthreads();  // (3)
      return;
    }
    if constexpr (RB::RC < RB::LAUNCH) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(RB::RC) : "memory");
    if constexpr (RB::RC > RB::LAUNCH) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(RB::RC) : "memory");
    convert_query();
    __syncthreads();  // (1)
    consume();
  }
}

}  // namespace wt
}  // namespace kvwall_mla

template <int HN>
static int launch_tokens(const kvwall_mla::Params* p, int head_blocks, int items, void* stream) {
  constexpr int NC = kvwall_mla::wt::consumers<HN>(), NP = kvwall_mla::wt::producers<HN>();
  using L = kvwall_mla::wt::Layout<HN, NC, NP>;
  auto kernel = kvwall_mla::wt::mla_wgmma_tokens_kernel<HN, NC, NP>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::SMEM);
  if (err != cudaSuccess) return (int)err;
  kernel<<<dim3(head_blocks, items), L::NT, L::SMEM, (cudaStream_t)stream>>>(*p);
  return (int)cudaGetLastError();
}

// Exploration: the setmaxnreg plan of the instantiation for `heads_per_cta` and the registers per thread its kernel
// launches with: out = {consumers, producers, LAUNCH (65,536 / threads, to a multiple of 8), RC, RP (both 0 where the
// kernel runs no setmaxnreg), numRegs (from cudaFuncGetAttributes: what the launch really allocates; -1 without a
// GPU, the other entries are filled all the same), threads}. The host refuses a plan whose increases the
// launch cannot cover (NC x RC + NP x RP > warpgroups x numRegs): setmaxnreg.inc would wait forever.
template <int HN>
static int budget_of(int* out) {
  using namespace kvwall_mla::wt;
  constexpr int NC = consumers<HN>(), NP = producers<HN>();
  using RB = Budget<HN, NC, NP>;
  cudaFuncAttributes attr;
  cudaError_t err = cudaFuncGetAttributes(&attr, mla_wgmma_tokens_kernel<HN, NC, NP>);
  out[0] = NC; out[1] = NP; out[2] = RB::LAUNCH; out[3] = RB::SETS ? RB::RC : 0; out[4] = RB::SETS ? RB::RP : 0;
  out[5] = err == cudaSuccess ? attr.numRegs : -1;
  out[6] = Layout<HN, NC, NP>::NT;
  return (int)err;
}
extern "C" {

int kvwall_mla_params_size() { return (int)sizeof(kvwall_mla::Params); }

// Dynamic shared memory per CTA, tokens per tile and threads of the instantiation for `heads_per_cta` (16 or 32);
// -1 for another head count.
int kvwall_mla_wgmma_tokens_shape(int heads_per_cta, int* smem, int* block_n, int* threads) {
  using namespace kvwall_mla::wt;
  if (heads_per_cta == 16) {
    *smem = Layout<16, consumers<16>(), producers<16>()>::SMEM;
    *threads = Layout<16, consumers<16>(), producers<16>()>::NT;
  } else if (heads_per_cta == 32) {
    *smem = Layout<32, consumers<32>(), producers<32>()>::SMEM;
    *threads = Layout<32, consumers<32>(), producers<32>()>::NT;
  } else {
    return -1;
  }
  *block_n = BN;
  return 0;
}

int kvwall_mla_wgmma_tokens_split(const kvwall_mla::Params* p, int heads_per_cta, int head_blocks, int items,
                                  void* stream) {
  if (items == 0 || head_blocks == 0) return 0;
  if (heads_per_cta == 16) return launch_tokens<16>(p, head_blocks, items, stream);
  if (heads_per_cta == 32) return launch_tokens<32>(p, head_blocks, items, stream);
  return (int)cudaErrorInvalidValue;
}

#ifdef KVWALL_TRACE
int kvwall_mla_tokens_trace(unsigned long long* host) {
  cudaError_t err = cudaMemcpyFromSymbol(host, kvwall_mla::wt::g_trace, sizeof(kvwall_mla::wt::g_trace));
  static const unsigned long long zeros[64] = {};
  if (err == cudaSuccess) err = cudaMemcpyToSymbol(kvwall_mla::wt::g_trace, zeros, sizeof(zeros));
  return (int)err;
}
#endif

int kvwall_mla_wgmma_tokens_budget(int heads_per_cta, int* out) {
  if (heads_per_cta == 16) return budget_of<16>(out);
  if (heads_per_cta == 32) return budget_of<32>(out);
  return -1;
}

const char* kvwall_mla_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

}  // extern "C"
