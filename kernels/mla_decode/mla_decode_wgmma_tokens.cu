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
//
// Three warpgroups (384 threads, one CTA per SM):
//   warpgroup 0, the consumer: the scores, the online softmax over the tokens (the M side: each warp holds 16 of a
//     tile's 64 tokens) with lazy rescaling, P^T into shared memory (the B operand) and the output product;
//   warpgroups 1 and 2, the producers: producer p gathers tiles p, p + 2, ... (16-byte loads into registers, the
//     heads-on-M kernel's gather) and converts them into buffer p, so its loads of tile t + 2 are in flight while the
//     consumer works on tiles t and t + 1: two tiles of loads in flight per SM, where one producer keeps one.
// setmaxnreg moves registers from the producers (128 per thread each) to the consumer (240): 240 + 2 x 128 = 496,
// within the 3 x 168 the CTA was launched with (an increase beyond what the CTA holds waits forever).
// The source is written for NC consumer and NP producer warpgroups; only NC = 1, NP = 2 is built (NOTES.md, generation
// 6, says what the other shapes did). Named barriers: K_READY[b] (producer b arrives, the consumer waits: buffer b
// holds the next tile), K_FREE[b] (the consumer arrives, producer b waits); CMAX0 and CP0 synchronize the consumer's
// four warps (128 threads). A multi-token query (q_len > 1, the front door's fold: H = q_len x heads rows, the CTA's
// HN columns) masks each head column at its token's causal limit; the q_len = 1 instantiation is the decode code.
// What this kernel shares with the heads-on-M kernel (the tile layout, the gather, the query prologue, barriers,
// descriptors, the C plumbing) is mla_decode_hopper.cuh.
#include "mla_decode_hopper.cuh"

namespace kvwall_mla {
namespace wt {

using namespace hopper;

constexpr int K_OFF = 0;  // two converted KV tiles
// With the tile barriers (K_READY0/1, K_FREE0/1, a producer and the consumer): CMAX and CP, the consumer's own
// (128 threads).
enum ConsumerBarrier { CMAX0 = 5, CP0 = 7 };

// HN heads per CTA (wgmma's N); NC consumer warpgroups, then NP producer warpgroups (built: NC = 1, NP = 2).
template <int HN, int NC, int NP>
struct Layout {
  static constexpr int NT = 128 * (NC + NP);
  static constexpr int QCHUNK = HN * 128;                // HN head rows x 64 float16 columns, swizzled
  static constexpr int Q_OFF = 2 * TILE;                 // the query block, [HN x 576] in 9 chunks
  static constexpr int P_OFF = Q_OFF + NCHUNK * QCHUNK;  // P^T [HN heads x 64 tokens]: one chunk
  static constexpr int F_OFF = P_OFF + NC * QCHUNK;      // floats: per-warp maxima and sums, score scales, a flag
  static constexpr int SMEM = F_OFF + (NC * 4 * HN + 4 * HN + 2 * HN) * 4 + 16;
};
// The warpgroups each instantiation is built with: one consumer, two producers.
template <int HN>
constexpr int consumers() {
  return 1;
}
template <int HN>
constexpr int producers() {
  return 2;
}
static_assert(Layout<16, 1, 2>::SMEM <= 232448 && Layout<32, 1, 2>::SMEM <= 232448, "shared memory per block");

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
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b), "r"(accumulate), "n"(TRANS_A));
}
template <int HN, int TRANS_A>
__device__ __forceinline__ void wgmma_hn(float (&d)[HN / 2], uint64_t a, uint64_t b, int accumulate) {
  if constexpr (HN == 16)
    wgmma_n16<TRANS_A>(d, a, b, accumulate);
  else
    wgmma_n32<TRANS_A>(d, a, b, accumulate);
}

// MULTI: a multi-token query (q_len > 1): head columns masked at their token's causal limit, columns with no token
// guarded.
template <int HN, int NC, int NP, bool MULTI>
__global__ void __launch_bounds__(Layout<HN, NC, NP>::NT, 1) mla_wgmma_tokens_kernel(const Params p) {
  using L = Layout<HN, NC, NP>;
  static_assert(NC == 1 && NP == 2, "built for one consumer and two producers");
  constexpr int NV = HN / 2;    // accumulator floats per thread of one m64nHN product
  constexpr int NCOL = HN / 4;  // distinct head columns per thread: 8 j + 2 c + {0, 1}, j < HN / 8
  extern __shared__ __align__(1024) uint8_t smem[];
  float* s_max0 = reinterpret_cast<float*>(smem + L::F_OFF);  // [NC][4 warps][HN]: each warp's tile maximum per head
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
  const ItemBounds ib = item_bounds(p, blockIdx.y);
  const long long lo = ib.lo, hi = ib.hi;
  const float2 scales = kv_scales(p);
  const float ckv_scale = scales.x;

  // ---- The producers' gather and conversion: producer pw's thread tid % 128.
  const int pw = wgi - NC;
  TileGather gather(p, ib, tid & 127);
  const int ntiles = gather.ntiles;
  if (wgi >= NC) {
    gather.fetch_index(pw);
    gather.load_tile(pw);
    gather.fetch_index(pw + NP);
  }

  // ---- Queries -> float16 into the swizzled Q block [HN rows x 576]: eight threads per head (tid < 8 HN),
  // 8-column groups part + 8 k (k < 9).
  if (tid < 8 * HN)
    query_prologue<8>(p, ib.b, h0 + (tid >> 3), tid >> 3, tid & 7, smem + L::Q_OFF, L::QCHUNK, scales, row_c, row_k);
  if (tid == 0) {
    *s_bad = 0;
    s_flag0[0] = s_flag0[1] = -1;
  }
  fence_async_smem();
  __syncthreads();

  auto head_of = [&](int ci) { return 8 * (ci >> 1) + 2 * c + (ci & 1); };
  auto col_of = [](int i) { return 2 * (i >> 2) + (i & 1); };  // accumulator index -> column index

  // The consumer's accumulators need more than an even share of the registers: 240 for it, 128 per producer.
  constexpr int RC = 240, RP = 128;
  constexpr bool REBALANCE = NC + NP > 2;
  if (wgi >= NC) {
    // ================= producer pw: gather and convert tiles pw, pw + NP, ... =================
    if constexpr (REBALANCE) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(RP) : "memory");
    for (int tl = pw; tl < ntiles; tl += NP) {
      const int buf = tl & 1;
      if (tl >= 2) bar_sync<256>(buf ? K_FREE1 : K_FREE0);  // the consumer is done with tile tl - 2 in buffer buf
      gather.convert_tile(smem + K_OFF, buf);               // raw holds tile tl
      if (tl + NP < ntiles) {
        gather.load_tile(tl + NP);
        gather.fetch_index(tl + 2 * NP);
      }
    }
    if (gather.bad) atomicOr(s_bad, 1);
#pragma unroll
    for (int k = 0; k < NC; ++k) __syncthreads();  // the consumers' barriers: after their loops, after the merge
    return;
  } else {
    // ================= the consumer: scores, softmax over the tokens, O^T += V^T P^T =================
    if constexpr (REBALANCE) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(RC) : "memory");
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
    int col_seen[NCOL];            // MULTI: the tokens of the chunk each head column may see (its token's causal limit)
    if constexpr (MULTI) {
#pragma unroll
      for (int ci = 0; ci < NCOL; ++ci) col_seen[ci] = row_tokens(p, ib, h0 + head_of(ci));
    }
    for (int it = wgi; it < ntiles; it += NC) {
      const uint32_t kbuf = base + K_OFF + (it & 1) * TILE;
      bar_sync<256>((it & 1) ? K_READY1 : K_READY0);
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
        if (tok >= live || (MULTI && tok >= col_seen[ci] - it * BN)) x = -INFINITY;
        sn[i] = x;
        over |= x > m_i[ci] + RESCALE;
      }
      if (__any_sync(0xffffffffu, over) && lane == 0) *reinterpret_cast<volatile int*>(s_flag) = it;
      // P^T [head][token] in float16 into the swizzled P chunk (row = head, 128 B = 64 tokens).
      auto write_p = [&](float (&sums)[NCOL]) {
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          const int ci = col_of(i), tok = t0 + ((i & 2) ? 8 : 0);
          const float pv = exp2f(sn[i] - (MULTI ? exp2_base(m_i[ci]) : m_i[ci]));  // MULTI: P = 0 for no token
          sums[ci] += pv;
          *reinterpret_cast<__half*>(smem + L::P_OFF + wgi * L::QCHUNK + swz(head_of(ci), tok >> 3) + 2 * (tok & 7)) =
              __float2half_rn(pv);
        }
        fence_async_smem();
        bar_sync<128>(CP0 + wgi);
      };
      write_p(lt);
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
        bar_sync<128>(CMAX0 + wgi);
        float alpha[NCOL];
#pragma unroll
        for (int ci = 0; ci < NCOL; ++ci) {
          const int h = head_of(ci);
          const float tm = fmaxf(fmaxf(s_max[h], s_max[HN + h]), fmaxf(s_max[2 * HN + h], s_max[3 * HN + h]));
          const float m = tm > m_i[ci] + RESCALE ? tm : m_i[ci];
          // MULTI: a column with no token yet keeps m = -inf (alpha 1, not exp2(-inf + inf))
          alpha[ci] = MULTI && m == m_i[ci] ? 1.f : exp2f(m_i[ci] - m);
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
#pragma unroll
      for (int b = 0; b < 8; ++b) pin(o[b]);
      wg_fence();
#pragma unroll
      for (int b = 0; b < 8; ++b) {
        // A = V^T for latent columns 64 b .. 64 b + 63: chunk b read MN-major (LBO: the next chunk, SBO: 8 token
        // rows); k-step ks = tokens 16 ks .. 16 ks + 15, 2048 bytes further. B = P^T, k-step 32 bytes further.
        const uint64_t va = gmma_desc(kbuf + b * CHUNK, CHUNK, 1024);
#pragma unroll
        for (int ks = 0; ks < BN / 16; ++ks) wgmma_hn<HN, 1>(o[b], va + ((ks * 2048) >> 4), pb0 + ((ks * 32) >> 4), 1);
      }
      wg_commit();
      wg_wait0();
#pragma unroll
      for (int b = 0; b < 8; ++b) pin(o[b]);
      if (it + 2 < ntiles) bar_arrive((it & 1) ? K_FREE1 : K_FREE0);
    }
    __syncthreads();  // every tile consumed; the producers' `bad` is in shared memory
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
    bar_sync<128>(CMAX0);
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
  }
}

}  // namespace wt
}  // namespace kvwall_mla

// The instantiation for HN heads per CTA, decode (q_len 1) or multi-token, launched for `p`.
template <int HN>
static int launch_tokens(const kvwall_mla::Params* p, int head_blocks, int items, void* stream) {
  using namespace kvwall_mla::wt;
  constexpr int NC = consumers<HN>(), NP = producers<HN>();
  using L = Layout<HN, NC, NP>;
  return kvwall_mla::hopper::launch(
      p->q_len > 1 ? mla_wgmma_tokens_kernel<HN, NC, NP, true> : mla_wgmma_tokens_kernel<HN, NC, NP, false>,
      head_blocks, items, L::NT, L::SMEM, stream, p);
}

extern "C" {

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
  if (heads_per_cta == 16) return launch_tokens<16>(p, head_blocks, items, stream);
  if (heads_per_cta == 32) return launch_tokens<32>(p, head_blocks, items, stream);
  return (int)cudaErrorInvalidValue;
}

}  // extern "C"
