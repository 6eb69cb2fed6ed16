// The heads-on-M split kernel for an even number of 64-row head blocks (128 heads: DeepSeek V3 / R1, GLM-5), q_len 1:
// the two CTAs of a cluster run the same plan item for head blocks 2k and 2k + 1, and each gathers and converts HALF
// of every tile's tokens, writing the float16 rows into its own tile buffer and, by st.async, into its partner's
// ("crossover", FlashMLA's sparse FP8 decode on Hopper), so each token is converted once per cluster while both CTAs'
// MMAs read the whole tile. Included by mla_decode_wgmma.cu (it reuses that file's wgmma wrappers); launched by its
// kvwall_mla_wgmma_split when the launch qualifies (kvwall_mla_wgmma_pair_refusal says when it does not).
//
// Inside a CTA, 384 threads, one CTA per SM, FlashMLA's BF16 "seesaw":
//   consumer c (warpgroups 0, 1; setmaxnreg 200): owns O[:, 256c : 256c + 256] and the tiles i = c mod 2: S = Q K^T
//     (36 wgmma m64n64k16, ONE accumulator: the rope/nope scale ratio is folded into the query before it is rounded),
//     the online softmax (the lazy rule of the one-CTA kernel, the reference maximum handed from tile i's owner to
//     tile i + 1's through shared memory), P into the tile's own rope chunk (stmatrix: the rope columns are dead once
//     the scores are done) and, in tile order, O_c = O_c alpha_i + P_i V_i[:, c] for every tile (the other consumer's
//     P read by ldmatrix).
//   producer (warpgroup 2; setmaxnreg 104): tile i's rows rank * 32 .. rank * 32 + 31 (rank: the CTA's place in its
//     cluster) into registers (16-byte loads, a tile ahead), converted (cvt.rn.f16x2.e4m3x2) into buffer i mod 2 of
//     both CTAs.
// Seesaw, a pair of tiles (i even: consumer 0's, i + 1: consumer 1's), each consumer in program order:
//   consumer 0: [READY0] S_i | softmax_i -> SMD0 | P_i V_i[:, 0:256] -> FREE0 | [SMD1] P_{i+1} V_{i+1} -> FREE1
//   consumer 1: [READY1] S_{i+1} | [SMD0] softmax_{i+1} -> SMD1 | P_i V_i[:, 256:] -> FREE0 | P_{i+1} V_{i+1} -> FREE1
//
// Hand-overs. Within a CTA, named barriers (ID: parties, count):
//   QB 1: the two consumers (256), once: the query block and the softmax state are initialized.
//   READY0/1 2/3: the producer arrives (128) after its half of tile i (its st.shared and a proxy fence), consumer b
//     syncs (256). Once per tile of parity b.
//   SMD0/1 6/7: consumer b arrives (128) after tile i's softmax (i = b mod 2), the other syncs (256). Once per tile.
//   END 8: all 384 (bar.red.or): the producer's out-of-range flag, and each consumer's row sums, before the write.
//   SDEAD0 10: consumer 0's own four warps (128) before its stmatrix of P_i over tile i's rope rows.
// Across the cluster, mbarriers in each CTA's shared memory:
//   PEER[b] (count 1 + tx): the local producer's thread 0 arrives with expect_tx = the partner's half of a tile
//     (32 rows x 576 columns x 2 B = 36,864 B) once per tile of parity b; the partner's st.async complete them.
//     Consumer b waits on it after READY b: then buffer b holds both halves.
//   FREE[b] (count 16): lane 0 of each warp of both consumers of BOTH CTAs arrives once it is done with tile i
//     (i = b mod 2, only when tile i + 2 exists): the producer of either CTA may then write tile i + 2's rows into
//     buffer b of both. The producer waits on its own FREE[b] before converting tile i + 2.
// No phase of a barrier can mix two tiles' arrivals: every new arrival on PEER[b] or FREE[b] for tile i + 2 needs the
// conversion of tile i + 2 by one of the two producers, which waits for FREE[b] of tile i, which needs every consumer
// of the cluster past its wait on PEER[b] for tile i. Both CTAs have the same item, so the same tile count.
// At the end, each producer ORs its out-of-range flag into both CTAs' flag words; a cluster barrier (after which no
// st.async or remote arrival is in flight) precedes the read of the flag and the exit.
#pragma once
#include <type_traits>

namespace kvwall_mla {
namespace pair {

using namespace hopper;

constexpr int HEADS = 64;                   // heads per CTA: wgmma's M
constexpr int NT = 384;                     // two consumer warpgroups + one producer
constexpr int Q_OFF = 0;                    // the query block [64 heads x 576], float16, 9 swizzled chunks
constexpr int K_OFF = TILE;                 // two converted tiles; buffer b holds tiles i = b mod 2 and, once tile
                                            // i's scores are done, its P [64 heads x 64 tokens] in chunk 8 (rope)
constexpr int F_OFF = 3 * TILE;             // floats: s_m[2][64], s_alpha[2][64], s_l[2][64], s_rc[64]
constexpr int B_OFF = F_OFF + 7 * 64 * 4;   // mbarriers: PEER[2], FREE[2]; then the out-of-range flag
constexpr int FLAG_OFF = B_OFF + 4 * 8;
constexpr int SMEM = FLAG_OFF + 16;         // 223,024 B (232,448 allowed per block)
constexpr int HALF_BYTES = 32 * D * 2;      // the partner's half of a tile: 36,864 B
constexpr int RC = 200, RP = 104;           // setmaxnreg: consumers, producer (2 x 200 + 104 = 504 = 3 x 168)
static_assert(2 * RC + RP <= 3 * 168 && RC % 8 == 0 && RP % 8 == 0, "setmaxnreg budget");
static_assert(SMEM <= 232448, "shared memory per block");
enum Barrier { QB = 1, READY0 = 2, READY1 = 3, SMD0 = 6, SMD1 = 7, END = 8, SDEAD0 = 10, PROD = 11 };
// How a producer's half reaches the partner: ST_ASYNC, 16-byte st.async per piece; BULK, one bulk copy per column
// chunk (4 KB: rows rank * 32 .. + 31 of the chunk) from this CTA's buffer, by one thread once the half is written;
// NONE (diagnostic: the partner's half is not sent, the output is wrong).
enum Exchange { ST_ASYNC = 1, BULK = 2, NONE = 3 };

template <int COUNT>
__device__ __forceinline__ void bsync(int id) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(COUNT) : "memory"); }
template <int COUNT>
__device__ __forceinline__ void barrive(int id) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(COUNT) : "memory"); }
// All 384 threads: the OR of `flag` over the CTA (barrier END).
__device__ __forceinline__ int bar_end_or(int flag) {
  int r;
  asm volatile("{\n .reg .pred p, q;\n setp.ne.s32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.s32 %0, 1, 0, q;\n}\n"
               : "=r"(r) : "r"(flag), "n"((int)END), "n"(NT) : "memory");
  return r;
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void stsm_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// ---- cluster primitives
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// The partner CTA's shared::cluster address of this CTA's shared address `a`.
__device__ __forceinline__ uint32_t peer_addr(uint32_t a, uint32_t peer) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(peer));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_arrive(uint32_t bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive_local(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_remote(uint32_t cluster_bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_bar) : "memory");
}
// Wait until the phase of parity `parity` of the mbarrier at `bar` has completed (acquire, cluster scope).
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// 16 bytes into the partner's shared memory at `cluster_addr`, completing 16 bytes of the mbarrier `cluster_bar`.
__device__ __forceinline__ void st_async16(uint32_t cluster_addr, uint4 v, uint32_t cluster_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n"
               ::"r"(cluster_addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(cluster_bar) : "memory");
}

// O (one consumer's [64 x 256] accumulators) and the row sums times the rows' factors, when any row of the warp has
// a factor other than 1 (lazy rescaling: rare after the first tile).
__device__ __forceinline__ void rescale(float (&o)[128], float (&l)[2], float a0, float a1) {
  if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      o[4 * j + 0] *= a0;
      o[4 * j + 1] *= a0;
      o[4 * j + 2] *= a1;
      o[4 * j + 3] *= a1;
    }
  }
  l[0] *= a0;
  l[1] *= a1;
}

// A bulk copy of `bytes` from this CTA's shared memory at `src` to the partner's at `cluster_dst`, completing them
// on the partner's mbarrier `cluster_bar`.
__device__ __forceinline__ void bulk_to_peer(uint32_t cluster_dst, uint32_t src, int bytes, uint32_t cluster_bar) {
  asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(cluster_dst), "r"(src), "r"(bytes), "r"(cluster_bar) : "memory");
}

template <int MODE>
__global__ void __launch_bounds__(NT, 1) mla_wgmma_pair_kernel(const Params p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  float* s_m = reinterpret_cast<float*>(smem + F_OFF);  // [2][64]: reference maximum after tile i, in slot i % 2
  float* s_alpha = s_m + 128;                           // [2][64]: tile i's rescale factor, slot i % 2
  float* s_l = s_alpha + 128;                           // [2][64]: consumer c's row sums, at the end
  float* s_rc = s_l + 128;                              // [64]: per head, the score scale (base 2)
  int* s_flag = reinterpret_cast<int*>(smem + FLAG_OFF);
  const uint32_t base = smem_addr(smem);
  if (base & 1023) __trap();  // the swizzle needs 1024-byte aligned chunks
  const uint32_t bar_peer0 = base + B_OFF, bar_free0 = base + B_OFF + 16;  // PEER[b] at +8b, FREE[b] at +16 + 8b

  const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, c4 = lane & 3;
  const int wgi = __shfl_sync(0xffffffffu, tid >> 7, 0);  // warp-uniform
  const uint32_t rank = cluster_rank(), peer = rank ^ 1u;
  const int h0 = blockIdx.x * HEADS;
  const ItemBounds ib = item_bounds(p, blockIdx.y);
  const long long start = ib.start, lo = ib.lo, hi = ib.hi;
  const float2 scales = kv_scales(p);
  const float ckv_scale = scales.x, kpe_scale = scales.y;
  const int ntiles = (int)((hi - lo + BN - 1) / BN);

  if (tid == 0) {
    mbar_init(bar_peer0, 1);
    mbar_init(bar_peer0 + 8, 1);
    mbar_init(bar_free0, 16);
    mbar_init(bar_free0 + 8, 16);
    *s_flag = 0;
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  cluster_sync();  // both CTAs' barriers and flags exist before any remote access

  if (wgi == 2) {
    // ================= producer: rows rank * 32 + lr of tile i into registers, into buffer i % 2 of both CTAs
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(RP) : "memory");
    const int page_shift = page_shift_of(p.page);
    int bad = 0;
    const int t = tid - 256, lr = t >> 2, lq = t & 3;
    const int row = (int)rank * 32 + lr;  // this thread's token row in every tile
    uint4 raw[PIECES];
    int entry_lo = 0, entry_hi = 0;  // the page-table entry of the next tile's row, as loaded (a tile ahead)
    const int lo32 = __shfl_sync(0xffffffffu, (int)lo, 0), len = __shfl_sync(0xffffffffu, (int)(hi - lo), 0);
    const int* idx32 = static_cast<const int*>(p.indices) + start;
    const long long* idx64 = static_cast<const long long*>(p.indices) + start;
    auto split = [&](int tt, int& pg, int& in_page) {
      if (page_shift >= 0) {
        pg = tt >> page_shift;
        in_page = tt & (p.page - 1);
      } else {
        pg = tt / p.page;
        in_page = tt - pg * p.page;
      }
    };
    auto fetch_index = [&](int tile) {
      const int rel = tile * BN + row;  // row of the item; live rows are < len (so tile < ntiles)
      entry_lo = entry_hi = 0;
      if (rel < len) {
        int i, in_page;
        split(lo32 + rel, i, in_page);
        if (p.indices64)
          asm volatile("ld.global.nc.v2.s32 {%0, %1}, [%2];\n" : "=r"(entry_lo), "=r"(entry_hi) : "l"(idx64 + i));
        else
          asm volatile("ld.global.nc.s32 %0, [%1];\n" : "=r"(entry_lo) : "l"(idx32 + i));
      }
    };
    auto load_row = [&](int tile) {  // after fetch_index(tile)
      const int rel = tile * BN + row;
      const bool live = rel < len;
      long long e = p.indices64 ? (long long)(((unsigned long long)(unsigned)entry_hi << 32) | (unsigned)entry_lo)
                                : (long long)entry_lo;
      if (live && (e < 0 || e >= p.num_units)) {
        bad = 1;
        e = 0;
      }
      int pg, in_page;
      split(lo32 + rel, pg, in_page);
      const long long slot = e * p.page + in_page;
      const uint4* sc = reinterpret_cast<const uint4*>(p.ckv + slot * p.stride_ckv) + lq;
      const uint4* sk = reinterpret_cast<const uint4*>(p.kpe + slot * p.stride_kpe) + lq;
#pragma unroll
      for (int k = 0; k < PIECES; ++k) raw[k] = live ? __ldg(k < 8 ? sc + 4 * k : sk) : make_uint4(0, 0, 0, 0);
    };
    // This lane's two 16-byte granules of its row in a chunk: swz(row, 2 lq) and that ^ 16.
    const uint32_t so0 = swz(row, 2 * lq), so1 = so0 ^ 16u;
    const uint32_t peer_base = peer_addr(base, peer);
    const uint32_t peer_bar0 = peer_addr(bar_peer0, peer);

    fetch_index(0);
    load_row(0);
    fetch_index(1);
    for (int i = 0; i < ntiles; ++i) {
      const int b = i & 1;
      if (i >= 2) mbar_wait(bar_free0 + 8 * b, ((i >> 1) - 1) & 1);  // every consumer of the cluster is done with i - 2
      if (t == 0) mbar_expect_arrive(bar_peer0 + 8 * b, MODE == NONE ? 0 : HALF_BYTES);  // the partner's half
      const uint32_t dst = K_OFF + b * TILE;
      const uint32_t rbar = peer_bar0 + 8 * b;
#pragma unroll
      for (int k = 0; k < PIECES; ++k) {
        uint32_t f[8];
        e4m3x4_to_f16x2x2(raw[k].x, f[0], f[1]);
        e4m3x4_to_f16x2x2(raw[k].y, f[2], f[3]);
        e4m3x4_to_f16x2x2(raw[k].z, f[4], f[5]);
        e4m3x4_to_f16x2x2(raw[k].w, f[6], f[7]);
        const uint32_t off = dst + k * CHUNK;
        const uint4 v0 = make_uint4(f[0], f[1], f[2], f[3]), v1 = make_uint4(f[4], f[5], f[6], f[7]);
        *reinterpret_cast<uint4*>(smem + off + so0) = v0;
        *reinterpret_cast<uint4*>(smem + off + so1) = v1;
        if constexpr (MODE == ST_ASYNC) {
          st_async16(peer_base + off + so0, v0, rbar);
          st_async16(peer_base + off + so1, v1, rbar);
        }
      }
      fence_async_smem();
      if constexpr (MODE == BULK) {
        bsync<128>(PROD);  // the whole half is written (and fenced for the async proxy)
        if (t == 0) {
#pragma unroll
          for (int k = 0; k < NCHUNK; ++k) {
            const uint32_t half = dst + k * CHUNK + rank * 32 * 128;
            bulk_to_peer(peer_base + half, base + half, 32 * 128, rbar);
          }
        }
      }
      barrive<256>(b ? READY1 : READY0);
      if (i + 1 < ntiles) {
        load_row(i + 1);
        fetch_index(i + 2);
      }
    }
    if (bad) {  // this half of the chunk held an out-of-range index: both CTAs' outputs become NaN
      atomicOr(s_flag, 1);
      asm volatile("red.relaxed.cluster.shared::cluster.or.b32 [%0], 1;\n" ::"r"(peer_addr(base + FLAG_OFF, peer))
                   : "memory");
    }
    bar_end_or(bad);
    cluster_sync();  // the partner may still read nothing of ours after this; its flag write is visible to it
    return;
  }

  // ================= consumers c = 0, 1 =================
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(RC) : "memory");
  // ---- Queries -> float16 into the swizzled Q block, each head scaled by 2^e (its largest |q| in [2^12, 2^15))
  // after the rope/nope scale ratio is folded into the part with the smaller scale, so that one accumulator holds
  // the whole score: logit (base 2) = S * big * qk_scale * 2^-e, big = the larger of the two scales (by size).
  // Head r = tid / 4, 8-column groups part + 4k (k < 18). Both consumers' 256 threads.
  {
    const bool fold_pe = fabsf(kpe_scale) <= fabsf(ckv_scale);
    const float big = fold_pe ? ckv_scale : kpe_scale;
    const float ratio = big != 0.f ? (fold_pe ? kpe_scale : ckv_scale) / big : 0.f;
    const float mul_n = fold_pe ? 1.f : ratio, mul_p = fold_pe ? ratio : 1.f;
    const int r = tid >> 2, part = tid & 3, h = h0 + r;
    const __nv_bfloat16* qn = p.qn + (long long)ib.b * p.stride_qn_b + (long long)h * p.stride_qn_h;
    const __nv_bfloat16* qp = p.qp + (long long)ib.b * p.stride_qp_b + (long long)h * p.stride_qp_h;
    constexpr int PER = D / 8 / 4;  // 18 groups of 8 columns per thread
    uint4 qw[PER];
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int i0 = (part + 4 * k) * 8;
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
      const float mul = (part + 4 * k) * 8 < DC ? mul_n : mul_p;
      const uint32_t ws[4] = {qw[k].x, qw[k].y, qw[k].z, qw[k].w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ws[e]));
        amax = fmaxf(amax, fmaxf(fabsf(f.x * mul), fabsf(f.y * mul)));
      }
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const int e2 = query_exponent(amax);
    const float qmul = ldexpf(1.f, e2);
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int grp = part + 4 * k;  // columns 8 grp .. 8 grp + 7: chunk grp / 8, granule grp % 8
      const float mul = grp * 8 < DC ? mul_n : mul_p;
      const uint32_t ws[4] = {qw[k].x, qw[k].y, qw[k].z, qw[k].w};
      uint32_t hw[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ws[e]));
        hw[e] = half2_bits((f.x * mul) * qmul, (f.y * mul) * qmul);
      }
      *reinterpret_cast<uint4*>(smem + Q_OFF + (grp >> 3) * CHUNK + swz(r, grp & 7)) =
          make_uint4(hw[0], hw[1], hw[2], hw[3]);
    }
    if (part == 0) s_rc[r] = (big * p.qk_scale) * ldexpf(1.f, -e2);
    if (tid < 64) s_m[64 + tid] = -INFINITY;  // slot 1: the reference "after tile -1", read by tile 0's owner
  }
  fence_async_smem();
  bsync<256>(QB);

  const int r0 = 16 * warp + g;    // this thread's accumulator rows: r0 and r0 + 8
  const int len = (int)(hi - lo);  // tokens of the item (below 2^31)
  const uint32_t peer_free0 = peer_addr(bar_free0, peer);
  // ldmatrix / stmatrix rows of this lane: matrix mi = lane / 8 of k-step ks is rows 16 warp + 8 (mi & 1) + 0..7,
  // granule (8 tokens) 2 ks + (mi >> 1) of a P chunk; recomputed at each use from %laneid (volatile: not hoisted).
  auto pm_off = [&](int ks) -> uint32_t {
    int ln;
    asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(ln));
    const int mi = ln >> 3, prow = 16 * warp + (ln & 7) + 8 * (mi & 1);
    return swz(prow, 2 * ks + (mi >> 1));
  };
  // This warp is done with buffer b's tile: lane 0 arrives on FREE[b] of both CTAs.
  auto release = [&](int b) {
    if (lane == 0) {
      mbar_arrive_local(bar_free0 + 8 * b);
      mbar_arrive_remote(peer_free0 + 8 * b);
    }
  };

  auto consume = [&](auto cc) {
    constexpr int C = decltype(cc)::value;
    constexpr int BAR_READY = C ? READY1 : READY0;
    constexpr int BAR_SMD_OWN = C ? SMD1 : SMD0, BAR_SMD_OTH = C ? SMD0 : SMD1;
    constexpr uint32_t OWN = K_OFF + C * TILE, OTH = K_OFF + (1 - C) * TILE;  // byte offsets of the two buffers
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float l_i[2] = {0.f, 0.f};  // this thread's share of the row sums of this consumer's own tiles
    const uint64_t qa0 = gmma_desc(base + Q_OFF, 16, 1024);                      // A: Q, K-major
    const uint64_t kb0 = gmma_desc(base + OWN, 16, 1024);                        // B of the scores: K, K-major
    const uint64_t vb_own = gmma_desc(base + OWN + 4 * C * CHUNK, CHUNK, 1024);  // B of P V: V[:, 256C ..], MN-major
    const uint64_t vb_oth = gmma_desc(base + OTH + 4 * C * CHUNK, CHUNK, 1024);

    // The other consumer's tile j: O_C = O_C alpha_j + P_j V_j[:, 256C ..] (P_j read by ldmatrix), then its buffer
    // is released for tile j + 2. The caller has synced SMD_OTH for tile j.
    auto pv_other = [&](int j) {
      rescale(o, l_i, s_alpha[64 * (1 - C) + r0], s_alpha[64 * (1 - C) + r0 + 8]);
      uint32_t pf[4][4];
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) ldsm_x4(pf[ks], base + OTH + 8 * CHUNK + pm_off(ks));
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) pin(pf[ks]);
      pin(o);
      wg_fence();
#pragma unroll
      for (int ks = 0; ks < BN / 16; ++ks) wg::wgmma_m64n256_rs<1>(o, pf[ks], vb_oth + ((ks * 2048) >> 4), 1);
      wg_commit();
      wg_wait0();
      pin(o);
      if (j + 2 < ntiles) release(1 - C);
    };
    // This consumer's tile i, first half: wait for both halves, S_i = Q K_i^T (36 wgmma, one accumulator).
    auto scores = [&](int i, float (&s)[32]) {
      bsync<256>(BAR_READY);                      // this CTA's half of tile i is in buffer C
      mbar_wait(bar_peer0 + 8 * C, (i >> 1) & 1);  // and the partner's half
      wg_fence();
#pragma unroll
      for (int kc = 0; kc < NCHUNK; ++kc) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint32_t step = (kc * CHUNK + kk * 32) >> 4;  // start address field in 16-byte units: no carry
          wg::wgmma_m64n64_ss<0>(s, qa0 + step, kb0 + step, kc + kk > 0);
        }
      }
      wg_commit();
      wg_wait0();
      pin(s);
    };
    // Second half: the softmax of tile i against m_{i-1} (shared-memory slot 1 - C; the caller has synced SMD_OTH
    // for tile i - 1, or i = 0), P_i / m_i / alpha_i published (SMD_OWN), P_i kept in registers for pv_own.
    auto softmax = [&](int i, float (&s)[32], uint32_t (&pr)[4][4], float (&alpha)[2], float (&ps)[2]) {
      const int live = min(BN, len - i * BN);
      const float rc0 = s_rc[r0], rc1 = s_rc[r0 + 8];
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int rw = e >> 1;
          float x = s[4 * j + e] * (rw ? rc1 : rc0);
          if (8 * j + 2 * c4 + (e & 1) >= live) x = -INFINITY;
          s[4 * j + e] = x;
          mx[rw] = fmaxf(mx[rw], x);
        }
      }
      const float mp[2] = {s_m[64 * (1 - C) + r0], s_m[64 * (1 - C) + r0 + 8]};  // m_{i-1} (-inf before tile 0)
      float m_new[2];
#pragma unroll
      for (int rw = 0; rw < 2; ++rw) {
        mx[rw] = fmaxf(mx[rw], __shfl_xor_sync(0xffffffffu, mx[rw], 1));
        mx[rw] = fmaxf(mx[rw], __shfl_xor_sync(0xffffffffu, mx[rw], 2));
        m_new[rw] = mx[rw] > mp[rw] + RESCALE ? mx[rw] : mp[rw];
        alpha[rw] = exp2f(mp[rw] - m_new[rw]);
      }
      ps[0] = ps[1] = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float p0 = exp2f(s[4 * j + 0] - m_new[0]), p1 = exp2f(s[4 * j + 1] - m_new[0]);
        const float p2 = exp2f(s[4 * j + 2] - m_new[1]), p3 = exp2f(s[4 * j + 3] - m_new[1]);
        ps[0] += p0 + p1;
        ps[1] += p2 + p3;
        pr[j >> 1][(j & 1) * 2 + 0] = half2_bits(p0, p1);
        pr[j >> 1][(j & 1) * 2 + 1] = half2_bits(p2, p3);
      }
      // P into chunk 8 of this buffer (the rope columns: the scores, their only reader, are done for all four warps:
      // SDEAD0 for consumer 0; consumer 1 has passed SMD0's sync), in the order the other consumer's ldmatrix reads.
      if constexpr (C == 0) bsync<128>(SDEAD0);
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) stsm_x4(base + OWN + 8 * CHUNK + pm_off(ks), pr[ks]);
      if (c4 == 0) {
        s_m[64 * C + r0] = m_new[0];
        s_m[64 * C + r0 + 8] = m_new[1];
        s_alpha[64 * C + r0] = alpha[0];
        s_alpha[64 * C + r0 + 8] = alpha[1];
      }
      barrive<256>(BAR_SMD_OWN);  // the other consumer reads P by ldmatrix (the generic proxy): no proxy fence
    };
    // O_C = O_C alpha_i + P_i V_i[:, 256C ..] with P_i from registers (or, RELOAD, read back by ldmatrix), then
    // the buffer released for tile i + 2.
    auto pv_own = [&](int i, uint32_t (&pr)[4][4], const float (&alpha)[2], const float (&ps)[2], auto reload) {
      if constexpr (decltype(reload)::value) {
        __syncwarp();  // this warp's stmatrix rows, read back by the same warp
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) ldsm_x4(pr[ks], base + OWN + 8 * CHUNK + pm_off(ks));
      }
      rescale(o, l_i, alpha[0], alpha[1]);
      l_i[0] += ps[0];
      l_i[1] += ps[1];
      pin(o);
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) pin(pr[ks]);
      wg_fence();
#pragma unroll
      for (int ks = 0; ks < BN / 16; ++ks) wg::wgmma_m64n256_rs<1>(o, pr[ks], vb_own + ((ks * 2048) >> 4), 1);
      wg_commit();
      wg_wait0();
      pin(o);
      if (i + 2 < ntiles) release(C);
    };

    if constexpr (C == 0) {
      for (int i = 0; i < ntiles; i += 2) {
        float s[32], alpha[2], ps[2];
        uint32_t pr[4][4];
        scores(i, s);
        softmax(i, s, pr, alpha, ps);
        pv_own(i, pr, alpha, ps, std::false_type{});
        if (i + 1 < ntiles) {
          bsync<256>(BAR_SMD_OTH);  // tile i + 1's softmax is done: m, alpha, P in shared memory
          pv_other(i + 1);
        }
      }
    } else {
      for (int i = 1; i < ntiles; i += 2) {
        float s[32], alpha[2], ps[2];
        uint32_t pr[4][4];
        scores(i, s);
        bsync<256>(BAR_SMD_OTH);  // tile i - 1's softmax is done: m_{i-1} for this softmax, alpha and P for P V
        softmax(i, s, pr, alpha, ps);
        pv_other(i - 1);
        pv_own(i, pr, alpha, ps, std::true_type{});
      }
      if (ntiles & 1) {  // the last tile, ntiles - 1, is consumer 0's
        bsync<256>(BAR_SMD_OTH);
        pv_other(ntiles - 1);
      }
    }

    // Row sums over the quad, each consumer's into shared memory; END publishes them with the local flag.
#pragma unroll
    for (int rw = 0; rw < 2; ++rw) {
      l_i[rw] += __shfl_xor_sync(0xffffffffu, l_i[rw], 1);
      l_i[rw] += __shfl_xor_sync(0xffffffffu, l_i[rw], 2);
    }
    if (c4 == 0) {
      s_l[64 * C + r0] = l_i[0];
      s_l[64 * C + r0 + 8] = l_i[1];
    }
    const int local_bad = bar_end_or(0);
    cluster_sync();  // both producers' flags are in; no st.async or remote arrival is in flight
    const int any_bad = local_bad | *reinterpret_cast<volatile int*>(s_flag);

    // ---- Normalize and write; NaN for a chunk that held an out-of-range index (in either half).
    const float* m_fin = s_m + 64 * ((ntiles - 1) & 1);  // the reference after the last tile (read only if l > 0)
    float norm[2], lse2[2];
#pragma unroll
    for (int rw = 0; rw < 2; ++rw) {
      float l = s_l[r0 + 8 * rw] + s_l[64 + r0 + 8 * rw];
      if (any_bad) l = NAN;
      const bool empty = l == 0.f;
      norm[rw] = empty ? 0.f : ckv_scale / l;
      lse2[rw] = empty ? -INFINITY : m_fin[r0 + 8 * rw] + log2f(l);
    }
    // Thread (g, c4) of warp w holds rows 16 w + g (+ 8) and columns 256 C + 8 j + 2 c4 + {0, 1}.
#pragma unroll
    for (int rw = 0; rw < 2; ++rw) {
      const int h = h0 + r0 + 8 * rw;
      if (h >= p.H) continue;
      if (ib.prow < 0) {
        __nv_bfloat16* orow = p.out + (long long)ib.b * p.stride_o_b + (long long)h * p.stride_o_h + 256 * C + 2 * c4;
#pragma unroll
        for (int j = 0; j < 32; ++j)
          *reinterpret_cast<__nv_bfloat162*>(orow + 8 * j) =
              __floats2bfloat162_rn(o[4 * j + 2 * rw] * norm[rw], o[4 * j + 2 * rw + 1] * norm[rw]);
        if (p.write_lse && C == 0 && c4 == 0) p.lse[(long long)ib.b * p.H + h] = lse2[rw] * 0.6931471805599453f;
      } else {
        float* prow_o = p.part_o + ((long long)ib.prow * p.H + h) * DC + 256 * C + 2 * c4;
#pragma unroll
        for (int j = 0; j < 32; ++j)
          *reinterpret_cast<float2*>(prow_o + 8 * j) =
              make_float2(o[4 * j + 2 * rw] * norm[rw], o[4 * j + 2 * rw + 1] * norm[rw]);
        if (C == 0 && c4 == 0) p.part_lse[(long long)ib.prow * p.H + h] = lse2[rw];
      }
    }
  };
  if (wgi == 0)
    consume(std::integral_constant<int, 0>{});
  else
    consume(std::integral_constant<int, 1>{});
}

// Clusters of two: head blocks 2k and 2k + 1 of one item.
template <int MODE>
inline int launch_pair(int head_blocks, int items, void* stream, const Params* p) {
  if (items == 0 || head_blocks == 0) return 0;
  cudaError_t err = cudaFuncSetAttribute(mla_wgmma_pair_kernel<MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
  if (err != cudaSuccess) return (int)err;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(head_blocks, items);
  cfg.blockDim = dim3(NT);
  cfg.dynamicSmemBytes = SMEM;
  cfg.stream = (cudaStream_t)stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 2;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  err = cudaLaunchKernelEx(&cfg, mla_wgmma_pair_kernel<MODE>, *p);
  if (err != cudaSuccess) return (int)err;
  return (int)cudaGetLastError();
}

// Clusters of this kernel that fit on the device at once (cudaOccupancyMaxActiveClusters), or a negative CUDA error.
inline int max_active_pairs() {
  cudaError_t err = cudaFuncSetAttribute(mla_wgmma_pair_kernel<BULK>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
  if (err != cudaSuccess) return -(int)err;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(2, 1);
  cfg.blockDim = dim3(NT);
  cfg.dynamicSmemBytes = SMEM;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 2;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  err = cudaOccupancyMaxActiveClusters(&n, (void*)mla_wgmma_pair_kernel<BULK>, &cfg);
  return err == cudaSuccess ? n : -(int)err;
}

}  // namespace pair
}  // namespace kvwall_mla
