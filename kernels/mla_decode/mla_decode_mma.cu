// Fused FP8 MLA decode, split kernel in CUDA C++ (mma.sync m16n8k16, cp.async, cvt.rn.f16x2.e4m3x2: sm_89 and
// later; built for sm_90, sm_100 and sm_120). The host side is kvwall.kernels.mla_decode.cuda.
//
// One CTA runs one item of the plan (a request and a chunk of its tokens) for a block of 16 heads (the MMA's M).
// Per tile of BN tokens:
//   1. cp.async gathers the tile's FP8 rows (512 B of ckv + 64 B of kpe per token, 16 B pieces) into a ring of
//      STAGES shared-memory buffers, STAGES - 1 tiles ahead of the math; tokens past the chunk are zero-filled.
//   2. Scores S[16 heads, BN tokens] = Q K^T: warps split the tokens. The B fragment of K^T is built straight
//      from the FP8 tile: one 16-byte shared load per token and 64 latent columns, one cvt per register. This
//      needs the latent columns permuted inside each 16-column k-step (k-slot 2c+i <-> column 16c+4j+i, k-slot
//      8+2c+i <-> 16c+4j+2+i for thread c of a quad and k-step j); the query's A fragment is read with the same
//      permutation, and a dot product does not change under a permutation applied to both sides.
//   3. Online softmax in base 2 (row maxima exchanged across warps through shared memory); P rounded to
//      float16 into shared memory.
//   4. O[16, 512] += P V with V = the same FP8 tile: warps split the 512 output columns. The B fragment needs
//      token pairs (2c, 2c+1) of one column: two 16-byte loads (two tokens), prmt pairs their bytes, one cvt per
//      register. The output columns are permuted instead of the tokens: n-tile j's column g <-> latent column
//      BPT*g + j inside the warp's slice, so each thread's accumulators hold runs of BPT consecutive columns.
// The math is the Triton kernel's: the query in float16 scaled per head by a power of two (largest |q| in
// [2^12, 2^15)), the FP8 values converted exactly to float16, float32 accumulation, P in float16, the partial
// (normalized float32 O and base-2 LSE) or the BF16 output written at the end. The combine is the Triton one.
#include "mla_decode_common.cuh"

namespace kvwall_mla {

constexpr int KV_STRIDE = D + 16;  // 592 B per token row in shared memory: conflict-free token-pair loads
constexpr int HEADS = 16;          // heads per CTA: the MMA's M

__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Where query element (row r, column i) sits in shared memory: in mma A-fragment order, so that one 16-byte load
// gives a lane the four registers of one k-step. Columns go in chunks of 64 (kc) and k-steps of 16 (j); inside a
// k-step, lane (g, c) holds rows g and g + 8 at columns 16c + 4j + {0, 1} (k-slots 2c, 2c + 1) and 16c + 4j + {2, 3}
// (k-slots 2c + 8, 2c + 9): the permutation the K fragment is read with.
__device__ __forceinline__ int q_fragment_offset(int r, int i) {
  const int kc = i / 64, within = i % 64;
  const int c = within / 16, j = (within % 16) / 4, e = within % 4;
  const int lane = (r % 8) * 4 + c;
  const int word = (e >> 1) * 2 + r / 8;  // a0: row g, cols +0/1; a1: row g+8; a2: row g, cols +2/3; a3: row g+8
  return (((kc * 4 + j) * 32 + lane) * 4 + word) * 2 + (e & 1);
}

template <int NW, int BN, int STAGES>
struct Shape {
  static constexpr int NT = NW * 32;      // threads
  static constexpr int TPW = BN / NW;     // tokens per warp in the scores
  static constexpr int NTQ = TPW / 8;     // score n-tiles per warp
  static constexpr int DW = DC / NW;      // output columns per warp
  static constexpr int NTV = DW / 8;      // output n-tiles per warp
  static constexpr int BPT = DW / 8;      // bytes per thread per token row in p @ V (= NTV)
  static constexpr int P_STRIDE = BN + 8; // halves per P row
  static constexpr int KV_BYTES = STAGES * BN * KV_STRIDE;
  static constexpr int Q_BYTES = HEADS * D * 2;  // in A-fragment order (q_fragment_offset)
  static constexpr int P_BYTES = HEADS * P_STRIDE * 2;
  static constexpr int RED_BYTES = 2 * NW * HEADS * 4;
  static constexpr int ROW_BYTES = 2 * HEADS * 4;
  static constexpr int SMEM = KV_BYTES + Q_BYTES + P_BYTES + RED_BYTES + ROW_BYTES;
  static constexpr int RPT = BN / (8 * NW);  // tile rows each thread copies
  static_assert(TPW % 8 == 0 && NTQ >= 1, "each warp scores whole n-tiles of 8 tokens");
  static_assert(BPT == 8 || BPT == 16, "a warp's output slice is 64 or 128 columns");
  static_assert(BN % 16 == 0, "p @ V runs in k-steps of 16 tokens");
  static_assert(RPT >= 1 && BN % (8 * NW) == 0, "a quad of lanes copies a row: 8 rows per warp per pass");
};

// Two FP8 e4m3 values -> float16x2 holding 2^-8 x each value, by moving bits on the integer pipes (no cvt): the
// e4m3 sign to bit 15, its 7 exponent-and-mantissa bits to bits 7..13 (the biases 7 and 15 differ by 8, and the
// subnormal steps line up, so this is exact). `a` and `b` are the source words, `sel` a prmt selector putting byte
// x of the pair in byte 0 and its sign replicated in byte 1 (and likewise the second value in bytes 2 and 3).
// e4m3's NaN becomes a finite value: used only for V, whose bytes are also K's, converted by cvt (NaN kept).
template <uint32_t SEL>
__device__ __forceinline__ uint32_t e4m3_pair_bits(uint32_t a, uint32_t b) {
  uint32_t d;  // prmt in PTX: a selector nibble with bit 3 set replicates that byte's sign (__byte_perm may not)
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "n"(SEL));
  return (d << 7) & 0xBF80BF80u;
}

template <int NW, int BN, int STAGES, int MINB, int VBITS>
__global__ void __launch_bounds__(NW * 32, MINB) mla_split_kernel(const Params p) {
  using S = Shape<NW, BN, STAGES>;
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* kv_s = smem;
  __half* q_s = reinterpret_cast<__half*>(smem + S::KV_BYTES);
  __half* p_s = reinterpret_cast<__half*>(smem + S::KV_BYTES + S::Q_BYTES);
  float* red_m = reinterpret_cast<float*>(smem + S::KV_BYTES + S::Q_BYTES + S::P_BYTES);
  float* red_l = red_m + NW * HEADS;
  float* row_c = red_l + NW * HEADS;
  float* row_k = row_c + HEADS;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int h0 = blockIdx.x * HEADS;
  const ItemBounds ib = item_bounds(p, blockIdx.y);
  const int b = ib.b, prow = ib.prow;
  const long long start = ib.start, lo = ib.lo, hi = ib.hi;
  const float ckv_scale = p.scale_from_ptr ? __ldg(p.ckv_scale_ptr) : p.ckv_scale_val;
  const float kpe_scale = p.scale_from_ptr ? __ldg(p.kpe_scale_ptr) : p.kpe_scale_val;

  // ---- The tile loader: a quad of lanes copies a row (lane q: 16-byte pieces q, q + 4, ..., 64 contiguous bytes
  // per quad per instruction, 8 rows per warp instruction), each thread RPT rows of a tile; cp.async, zero-filled
  // past the chunk. Each thread's page-table entries for the next tile it copies are loaded one tile ahead.
  int bad = 0;
  const int ntiles = (int)((hi - lo + BN - 1) / BN);
  const int quad_lane = lane & 3;
  long long next_raw[S::RPT];
  auto tile_row = [&](int k) { return warp * 8 + (lane >> 2) + k * 8 * NW; };
  auto fetch_index = [&](int tile) {
#pragma unroll
    for (int k = 0; k < S::RPT; ++k) {
      const long long t = lo + (long long)tile * BN + tile_row(k);
      next_raw[k] = 0;
      if (tile < ntiles && t < hi) {
        const int tt = (int)t;  // token positions are below 2^31
        next_raw[k] = load_index(p.indices, start + (p.page == 1 ? tt : tt / p.page), p.indices64);
      }
    }
  };
  auto issue_tile = [&](int tile) {  // after fetch_index(tile)
    if (tile >= ntiles) return;
    uint8_t* dst0 = kv_s + (tile % STAGES) * BN * KV_STRIDE + quad_lane * 16;
#pragma unroll
    for (int k = 0; k < S::RPT; ++k) {
      const int r = tile_row(k);
      const long long t = lo + (long long)tile * BN + r;
      const bool live = t < hi;
      long long raw = live ? next_raw[k] : 0;
      if (raw < 0 || raw >= p.num_units) {
        bad = 1;
        raw = 0;
      }
      const long long slot = p.page == 1 ? raw : raw * p.page + (int)t % p.page;
      const uint8_t* src_c = p.ckv + slot * p.stride_ckv + quad_lane * 16;
      const uint8_t* src_k = p.kpe + slot * p.stride_kpe + quad_lane * 16;
      uint8_t* dst = dst0 + r * KV_STRIDE;
      const int n = live ? 16 : 0;
#pragma unroll
      for (int i = 0; i < DC / 64; ++i) cp_async16(dst + i * 64, src_c + i * 64, n);
      cp_async16(dst + DC, src_k, n);
    }
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    fetch_index(s);
    issue_tile(s);
    cp_async_commit();
  }
  fetch_index(STAGES - 1);

  // ---- Queries -> float16 in shared memory (while the first tiles are on their way), each head scaled by 2^e so
  // that its largest |q| is in [2^12, 2^15); stored in A-fragment order (q_fragment_offset).
  {
    constexpr int TPH = S::NT / HEADS;  // threads per head, consecutive lanes
    const int r = tid / TPH, part = tid % TPH;
    const int h = h0 + r;
    const __nv_bfloat16* qn = p.qn + (long long)b * p.stride_qn_b + (long long)h * p.stride_qn_h;
    const __nv_bfloat16* qp = p.qp + (long long)b * p.stride_qp_b + (long long)h * p.stride_qp_h;
    constexpr int GROUPS = D / 8;                      // 8 columns (16 bytes) per group
    constexpr int PER = (GROUPS + TPH - 1) / TPH;      // groups per thread
    float v[PER][8];
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int g0 = part + k * TPH, i0 = g0 * 8;
      if (g0 < GROUPS && h < p.H) {
        if (p.q_vec) {  // one 16-byte load per group, all in flight at once
          const uint4 w = __ldg(reinterpret_cast<const uint4*>(i0 < DC ? qn + i0 : qp + (i0 - DC)));
          const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ws[e]));
            v[k][2 * e] = f.x;
            v[k][2 * e + 1] = f.y;
          }
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) v[k][e] = __bfloat162float(i0 < DC ? qn[i0 + e] : qp[i0 + e - DC]);
        }
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[k][e] = 0.f;
      }
    }
    float amax = 0.f;
#pragma unroll
    for (int k = 0; k < PER; ++k)
#pragma unroll
      for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[k][e]));
#pragma unroll
    for (int off = TPH / 2; off >= 1; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const int e2 = query_exponent(amax);
    const float qmul = ldexpf(1.f, e2);
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int g0 = part + k * TPH;
      if (g0 < GROUPS) {  // columns i0 + 4jj + {0,1} and + {2,3}: two float16 pairs (32-bit words) per half-group
#pragma unroll
        for (int e = 0; e < 8; e += 2)
          *reinterpret_cast<__half2*>(q_s + q_fragment_offset(r, g0 * 8 + e)) =
              __floats2half2_rn(v[k][e] * qmul, v[k][e + 1] * qmul);
      }
    }
    if (part == 0) {
      row_c[r] = (ckv_scale * p.qk_scale) * ldexpf(1.f, -e2);
      row_k[r] = (kpe_scale * p.qk_scale) * ldexpf(1.f, -e2);
    }
  }

  float o[S::NTV][4];
#pragma unroll
  for (int j = 0; j < S::NTV; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m_i[2] = {-INFINITY, -INFINITY};  // rows g and g + 8
  float l_i[2] = {0.f, 0.f};              // this thread's share of the row sums

  for (int it = 0; it < ntiles; ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile `it` is in; every warp is done with tile it - 1 (its stage is free)
    issue_tile(it + STAGES - 1);
    cp_async_commit();
    fetch_index(it + STAGES);
    const uint8_t* kv = kv_s + (it % STAGES) * BN * KV_STRIDE;

    // ---- Scores for this warp's tokens: nope (8 chunks of 64 columns) and rope (1 chunk) apart.
    // Two accumulators for the nope part (even and odd chunks): shorter dependent chains of MMAs.
    float sc[S::NTQ][4], sc2[S::NTQ][4], sr[S::NTQ][4];
#pragma unroll
    for (int n = 0; n < S::NTQ; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) sc[n][i] = sc2[n][i] = sr[n][i] = 0.f;
#pragma unroll
    for (int kc = 0; kc < D / 64; ++kc) {
      const uint4* qf = reinterpret_cast<const uint4*>(q_s) + kc * 4 * 32 + lane;  // k-step j at qf[32 * j]
      uint4 qa[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) qa[j] = qf[32 * j];
#pragma unroll
      for (int n = 0; n < S::NTQ; ++n) {
        const int token = warp * S::TPW + n * 8 + g;
        const uint4 kb = *reinterpret_cast<const uint4*>(kv + token * KV_STRIDE + kc * 64 + 16 * c);
        const uint32_t kw[4] = {kb.x, kb.y, kb.z, kb.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t b0, b1;
          e4m3x4_to_f16x2x2(kw[j], b0, b1);
          if (kc < DC / 64 && kc % 2 == 0)
            mma16816(sc[n], qa[j].x, qa[j].y, qa[j].z, qa[j].w, b0, b1);
          else if (kc < DC / 64)
            mma16816(sc2[n], qa[j].x, qa[j].y, qa[j].z, qa[j].w, b0, b1);
          else
            mma16816(sr[n], qa[j].x, qa[j].y, qa[j].z, qa[j].w, b0, b1);
        }
      }
    }

    // ---- Logits (base 2), masked past the chunk; row maxima across the warp, then across warps.
    const long long tile_first = lo + (long long)it * BN;
    const float rc0 = row_c[g], rc1 = row_c[g + 8], rk0 = row_k[g], rk1 = row_k[g + 8];
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < S::NTQ; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int token = warp * S::TPW + n * 8 + 2 * c + (i & 1);
        const int row = i >> 1;
        const float snope = sc[n][i] + sc2[n][i];
        float x = row ? snope * rc1 + sr[n][i] * rk1 : snope * rc0 + sr[n][i] * rk0;
        if (tile_first + token >= hi) x = -INFINITY;
        sc[n][i] = x;
        mx[row] = fmaxf(mx[row], x);
      }
    }
#pragma unroll
    for (int row = 0; row < 2; ++row) {
      mx[row] = fmaxf(mx[row], __shfl_xor_sync(0xffffffffu, mx[row], 1));
      mx[row] = fmaxf(mx[row], __shfl_xor_sync(0xffffffffu, mx[row], 2));
    }
    if (c == 0) {
      red_m[warp * HEADS + g] = mx[0];
      red_m[warp * HEADS + g + 8] = mx[1];
    }
    __syncthreads();
    float alpha[2];
#pragma unroll
    for (int row = 0; row < 2; ++row) {
      float m = m_i[row];
#pragma unroll
      for (int w = 0; w < NW; ++w) m = fmaxf(m, red_m[w * HEADS + g + 8 * row]);
      alpha[row] = exp2f(m_i[row] - m);
      m_i[row] = m;
      l_i[row] *= alpha[row];
    }
    // ---- P = 2^(logit - m), float16 into shared memory; the row sums in float32 before rounding.
#pragma unroll
    for (int n = 0; n < S::NTQ; ++n) {
      const int token = warp * S::TPW + n * 8 + 2 * c;
      const float p0 = exp2f(sc[n][0] - m_i[0]), p1 = exp2f(sc[n][1] - m_i[0]);
      const float p2 = exp2f(sc[n][2] - m_i[1]), p3 = exp2f(sc[n][3] - m_i[1]);
      l_i[0] += p0 + p1;
      l_i[1] += p2 + p3;
      *reinterpret_cast<__half2*>(p_s + g * S::P_STRIDE + token) = __floats2half2_rn(p0, p1);
      *reinterpret_cast<__half2*>(p_s + (g + 8) * S::P_STRIDE + token) = __floats2half2_rn(p2, p3);
    }
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {  // most tiles leave the maxima alone
#pragma unroll
      for (int j = 0; j < S::NTV; ++j) {
        o[j][0] *= alpha[0];
        o[j][1] *= alpha[0];
        o[j][2] *= alpha[1];
        o[j][3] *= alpha[1];
      }
    }
    __syncthreads();

    // ---- O += P V over this warp's output columns; V's B fragment from token pairs of the FP8 tile.
    const uint8_t* vcol = kv + warp * S::DW + S::BPT * g;
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks) {
      const int t0 = ks * 16 + 2 * c;
      const uint32_t a0 = *reinterpret_cast<const uint32_t*>(p_s + g * S::P_STRIDE + t0);
      const uint32_t a1 = *reinterpret_cast<const uint32_t*>(p_s + (g + 8) * S::P_STRIDE + t0);
      const uint32_t a2 = *reinterpret_cast<const uint32_t*>(p_s + g * S::P_STRIDE + t0 + 8);
      const uint32_t a3 = *reinterpret_cast<const uint32_t*>(p_s + (g + 8) * S::P_STRIDE + t0 + 8);
      uint32_t v[4][S::BPT / 4];  // tokens t0, t0 + 1, t0 + 8, t0 + 9
#pragma unroll
      for (int tt = 0; tt < 4; ++tt) {
        const uint8_t* src = vcol + (t0 + (tt & 1) + 8 * (tt >> 1)) * KV_STRIDE;
        if constexpr (S::BPT == 16) {
          const uint4 x = *reinterpret_cast<const uint4*>(src);
          v[tt][0] = x.x; v[tt][1] = x.y; v[tt][2] = x.z; v[tt][3] = x.w;
        } else {
          const uint2 x = *reinterpret_cast<const uint2*>(src);
          v[tt][0] = x.x; v[tt][1] = x.y;
        }
      }
#pragma unroll
      for (int q = 0; q < S::BPT / 4; ++q) {
        uint32_t x0, x1, x2, x3, y0, y1, y2, y3;  // n-tiles 4q .. 4q + 3: tokens (t0, t0 + 1) and (t0 + 8, t0 + 9)
        if constexpr (VBITS) {  // byte j of tokens t and t + 1, each with its sign replicated above it
          x0 = e4m3_pair_bits<0xC480>(v[0][q], v[1][q]);
          x1 = e4m3_pair_bits<0xD591>(v[0][q], v[1][q]);
          x2 = e4m3_pair_bits<0xE6A2>(v[0][q], v[1][q]);
          x3 = e4m3_pair_bits<0xF7B3>(v[0][q], v[1][q]);
          y0 = e4m3_pair_bits<0xC480>(v[2][q], v[3][q]);
          y1 = e4m3_pair_bits<0xD591>(v[2][q], v[3][q]);
          y2 = e4m3_pair_bits<0xE6A2>(v[2][q], v[3][q]);
          y3 = e4m3_pair_bits<0xF7B3>(v[2][q], v[3][q]);
        } else {
          e4m3x4_to_f16x2x2(__byte_perm(v[0][q], v[1][q], 0x5140), x0, x1);
          e4m3x4_to_f16x2x2(__byte_perm(v[0][q], v[1][q], 0x7362), x2, x3);
          e4m3x4_to_f16x2x2(__byte_perm(v[2][q], v[3][q], 0x5140), y0, y1);
          e4m3x4_to_f16x2x2(__byte_perm(v[2][q], v[3][q], 0x7362), y2, y3);
        }
        mma16816(o[4 * q + 0], a0, a1, a2, a3, x0, y0);
        mma16816(o[4 * q + 1], a0, a1, a2, a3, x1, y1);
        mma16816(o[4 * q + 2], a0, a1, a2, a3, x2, y2);
        mma16816(o[4 * q + 3], a0, a1, a2, a3, x3, y3);
      }
    }
  }
  cp_async_wait<0>();

  // ---- Row sums across the quad and the warps; NaN for a chunk that held an out-of-range index.
#pragma unroll
  for (int row = 0; row < 2; ++row) {
    l_i[row] += __shfl_xor_sync(0xffffffffu, l_i[row], 1);
    l_i[row] += __shfl_xor_sync(0xffffffffu, l_i[row], 2);
  }
  if (c == 0) {
    red_l[warp * HEADS + g] = l_i[0];
    red_l[warp * HEADS + g + 8] = l_i[1];
  }
  const int any_bad = __syncthreads_or(bad);
  float norm[2], lse2[2];
#pragma unroll
  for (int row = 0; row < 2; ++row) {
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) l += red_l[w * HEADS + g + 8 * row];
    if (any_bad) l = NAN;
    const bool empty = l == 0.f;
    norm[row] = empty ? 0.f : ckv_scale * (VBITS ? 256.f : 1.f) / l;
    lse2[row] = empty ? -INFINITY : m_i[row] + log2f(l);
  }

  // ---- Write: thread (g, c) of warp w holds rows g, g + 8 and columns w*DW + BPT*(2c + i) + j, j < BPT.
#pragma unroll
  for (int row = 0; row < 2; ++row) {
    const int h = h0 + g + 8 * row;
    if (h >= p.H) continue;
    if (prow < 0) {
      __nv_bfloat16* orow = p.out + (long long)b * p.stride_o_b + (long long)h * p.stride_o_h;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        __nv_bfloat16* dst = orow + warp * S::DW + S::BPT * (2 * c + i);
        if (p.out_vec) {  // BPT consecutive columns: 16-byte stores
          uint32_t packed[S::BPT / 2];
#pragma unroll
          for (int j = 0; j < S::BPT; j += 2) {
            const __nv_bfloat162 two = __floats2bfloat162_rn(o[j][2 * row + i] * norm[row],
                                                              o[j + 1][2 * row + i] * norm[row]);
            packed[j / 2] = *reinterpret_cast<const uint32_t*>(&two);
          }
#pragma unroll
          for (int j = 0; j < S::BPT / 8; ++j)
            reinterpret_cast<uint4*>(dst)[j] =
                make_uint4(packed[4 * j], packed[4 * j + 1], packed[4 * j + 2], packed[4 * j + 3]);
        } else {
#pragma unroll
          for (int j = 0; j < S::BPT; ++j) dst[j] = __float2bfloat16_rn(o[j][2 * row + i] * norm[row]);
        }
      }
      if (p.write_lse && warp == 0 && c == 0) p.lse[(long long)b * p.H + h] = lse2[row] * 0.6931471805599453f;
    } else {
      float* prow_o = p.part_o + ((long long)prow * p.H + h) * DC + warp * S::DW;
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < S::BPT; j += 4) {
          float4 v = make_float4(o[j][2 * row + i] * norm[row], o[j + 1][2 * row + i] * norm[row],
                                 o[j + 2][2 * row + i] * norm[row], o[j + 3][2 * row + i] * norm[row]);
          *reinterpret_cast<float4*>(prow_o + S::BPT * (2 * c + i) + j) = v;
        }
      if (warp == 0 && c == 0) p.part_lse[(long long)prow * p.H + h] = lse2[row];
    }
  }
}

template <int NW, int BN, int STAGES, int MINB, int VBITS>
int launch(const Params& p, int head_blocks, int items, cudaStream_t stream) {
  using S = Shape<NW, BN, STAGES>;
  auto kernel = mla_split_kernel<NW, BN, STAGES, MINB, VBITS>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::SMEM);
  if (err != cudaSuccess) return (int)err;
  kernel<<<dim3(head_blocks, items), S::NT, S::SMEM, stream>>>(p);
  return (int)cudaGetLastError();
}

}  // namespace kvwall_mla

// The variants the host side may pick: (warps, tokens per tile, pipeline stages, CTAs per SM the registers are
// capped for, V converted by bit moves instead of cvt).
#define KVWALL_MLA_VARIANTS(X) \
  X(0, 4, 64, 4, 1, 0)         \
  X(1, 4, 128, 2, 1, 0)        \
  X(2, 8, 128, 2, 1, 0)        \
  X(3, 4, 32, 4, 2, 0)         \
  X(4, 8, 64, 2, 2, 0)         \
  X(5, 4, 64, 2, 2, 0)         \
  X(6, 4, 64, 2, 2, 1)         \
  X(7, 8, 128, 2, 1, 1)        \
  X(8, 4, 64, 4, 1, 1)         \
  X(9, 8, 64, 2, 2, 1)

extern "C" {

int kvwall_mla_params_size() { return (int)sizeof(kvwall_mla::Params); }

// Shape of variant v: warps, tokens per tile, stages, dynamic shared memory bytes; -1 for an unknown variant.
int kvwall_mla_variant(int v, int* warps, int* block_n, int* stages, int* smem) {
  switch (v) {
#define X(id, nw, bn, st, mb, vb)                                      \
  case id:                                                             \
    *warps = nw;                                                       \
    *block_n = bn;                                                     \
    *stages = st;                                                      \
    *smem = kvwall_mla::Shape<nw, bn, st>::SMEM;                       \
    return 0;
    KVWALL_MLA_VARIANTS(X)
#undef X
  }
  return -1;
}

int kvwall_mla_split(const kvwall_mla::Params* p, int variant, int head_blocks, int items, void* stream) {
  if (items == 0 || head_blocks == 0) return 0;
  switch (variant) {
#define X(id, nw, bn, st, mb, vb) \
  case id:                        \
    return kvwall_mla::launch<nw, bn, st, mb, vb>(*p, head_blocks, items, (cudaStream_t)stream);
    KVWALL_MLA_VARIANTS(X)
#undef X
  }
  return (int)cudaErrorInvalidValue;
}

const char* kvwall_mla_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

}  // extern "C"
