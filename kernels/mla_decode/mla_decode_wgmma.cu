// Fused FP8 MLA decode, split kernel for Hopper in CUDA C++ with warpgroup MMA (wgmma: sm_90a only). The host side
// is kvwall.kernels.mla_decode.wgmma; the same plan, numerics and combine as the Triton path (kernel.py).
//
// One CTA (two warpgroups, 256 threads, one CTA per SM) runs one plan item for a block of 64 heads (wgmma's M).
// The FP8 tile of 64 tokens is converted ONCE to float16 in shared memory, in the 128-byte-swizzled layout wgmma
// reads: 9 chunks of 64 columns, each [64 tokens x 128 B]. The same buffer is K for the scores (K-major B) and V
// for the output (MN-major B: a 16-bit type may be read transposed), so the tile is read from HBM once and
// converted once for all 64 heads. Two tile buffers; the warpgroups split the work (FlashMLA's BF16 kernel's
// division, with the conversion given to the warpgroup that has ALU time to spare):
//   warpgroup 0 (the critical path): S = Q K^T for the whole tile (36 wgmma m64n64k16, Q [64 x 576] float16 from
//     shared memory, nope and rope accumulated apart as their scales differ); the online softmax on whole rows (no
//     exchange: a thread holds 16 of its two rows' 64 logits), the reference maximum moved lazily (only when a
//     tile exceeds it by 2^8); P rounded to float16, kept in registers for its own P V (wgmma with A from registers)
//     and written to shared memory with the rows' rescale factors for warpgroup 1; O[:, 0:256] += P V.
//   warpgroup 1: gathers each tile's FP8 rows into registers (16-byte loads, a tile ahead), converts them into the
//     free buffer (cvt.rn.f16x2.e4m3x2) and O[:, 256:512] += P V with P read into registers by ldmatrix (so the P
//     hand-off stays in the generic proxy: no proxy fence on warpgroup 0's side).
// Named barriers pass the buffers and P between the two: K_READY[b] (1 -> 0: buffer b holds the next tile), K_FREE[b]
// (0 -> 1: warpgroup 0 is done with buffer b), P_READY (0 -> 1: P and the factors are written), P_FREE (1 -> 0:
// warpgroup 1 has P in registers). Each producer waits for the matching release before it arrives again, so no
// barrier ever counts two phases' arrivals together.
// A multi-token query (q_len > 1, the front door's fold: H = q_len x heads rows, e.g. 16 heads x 4 draft tokens in
// one CTA's 64 rows) masks each row at its token's causal limit; the q_len = 1 instantiation is the decode code.
// What this kernel shares with the tokens-on-M kernel (the tile layout, the gather, the query prologue, barriers,
// descriptors, the C plumbing) is mla_decode_hopper.cuh.
#include "mla_decode_hopper.cuh"

namespace kvwall_mla {
namespace wg {

using namespace hopper;

constexpr int HEADS = 64;                 // heads per CTA: wgmma's M
constexpr int NT = 256;                   // two warpgroups
constexpr int Q_OFF = 0;                  // the query block
constexpr int K_OFF = TILE;               // two converted KV tiles
constexpr int P_OFF = 3 * TILE;           // P [64 heads x 64 tokens]
constexpr int F_OFF = P_OFF + CHUNK;      // per head: rescale factor, row sum, nope and rope score scales
constexpr int SMEM = F_OFF + 4 * 64 * 4;  // 230,400 B (H100 / H200 allow 232,448 per block)
// With the tile barriers (K_READY0/1, K_FREE0/1): P_READY (0 -> 1: P and the factors are written), P_FREE (1 -> 0:
// warpgroup 1 has P in registers).
enum PBarrier { P_READY = 5, P_FREE = 6 };

// ---- KVWALL_TRACE (a diagnostic build, never the shipped one): lane 0 of each warpgroup's first warp reads clock64()
// at every phase boundary and sums the cycles per phase in shared memory; at the end each CTA adds its sums to
// g_trace[warpgroup][phase] (slot 14 counts CTAs, 15 tiles), read back by kvwall_mla_trace().
#ifdef KVWALL_TRACE
__device__ unsigned long long g_trace[2][16];
#define TRACE_DECL __shared__ unsigned long long s_tr[2][17];
#define TRACE_INIT                                          \
  if ((tid & 127) == 0) {                                   \
    for (int k_ = 0; k_ < 16; ++k_) s_tr[tid >> 7][k_] = 0; \
    s_tr[tid >> 7][16] = clock64();                         \
  }
#define TRACE(k)                                    \
  if ((tid & 127) == 0) {                           \
    const unsigned long long now_ = clock64();      \
    s_tr[tid >> 7][k] += now_ - s_tr[tid >> 7][16]; \
    s_tr[tid >> 7][16] = now_;                      \
  }
#define TRACE_END                                                                          \
  if ((tid & 127) == 0) {                                                                  \
    for (int k_ = 0; k_ < 14; ++k_) atomicAdd(&g_trace[tid >> 7][k_], s_tr[tid >> 7][k_]); \
    atomicAdd(&g_trace[tid >> 7][14], 1ull);                                               \
    atomicAdd(&g_trace[tid >> 7][15], (unsigned long long)ntiles);                         \
  }
#else
#define TRACE_DECL
#define TRACE_INIT
#define TRACE(k)
#define TRACE_END
#endif

// D[64 x N] (+)= A[64 x 16] B[16 x N], float16 in, float32 accumulators in the m64nN register layout (warp w of the
// warpgroup: rows 16 w + lane / 4 (+ 8), columns 8 j + 2 (lane % 4) (+ 1) in d[4 j .. 4 j + 3]). B from shared memory
// by descriptor, K-major (TRANS_B = 0) or MN-major (1); A from shared memory by descriptor (_ss, K-major) or from
// registers (_rs: four registers per thread in the m16n8k16 A-fragment order of the thread's warp rows).
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
      "}, %32, %33, p, 1, 1, 0, %35;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_B));
}

template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n256_rs(float (&d)[128], const uint32_t (&a)[4], uint64_t desc_b,
                                                 int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
      "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
      "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
      "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
      "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
      "}, {%128,%129,%130,%131}, %132, p, 1, 1, %134;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]),
        "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]),
        "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]),
        "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]),
        "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]),
        "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]),
        "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]),
        "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]),
        "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(TRANS_B));
}

// MULTI: a multi-token query (q_len > 1): rows masked at their token's causal limit, rows with no token guarded.
template <bool MULTI>
__global__ void __launch_bounds__(NT, 1) mla_wgmma_split_kernel(const Params p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  TRACE_DECL
  float* s_alpha = reinterpret_cast<float*>(smem + F_OFF);  // per head: this tile's O rescale factor
  float* s_sum = s_alpha + 64;                              // per head: the row sum, at the end
  float* row_c = s_sum + 64;                                // per head: score scale of the nope part
  float* row_k = row_c + 64;                                // and of the rope part
  const uint32_t base = smem_addr(smem);
  if (base & 1023) __trap();  // the swizzle needs 1024-byte aligned chunks

  const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31;
  TRACE_INIT
  const int g = lane >> 2, c = lane & 3;
  // The warpgroup index through a shuffle from lane 0, so the compiler knows it is warp-uniform: the wgmma
  // descriptors built from it then stay in uniform registers.
  const int wgi = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const int h0 = blockIdx.x * HEADS;
  const ItemBounds ib = item_bounds(p, blockIdx.y);
  const long long lo = ib.lo, hi = ib.hi;
  const float2 scales = kv_scales(p);
  const float ckv_scale = scales.x;

  // ---- Warpgroup 1's gather (constructed here so that the first tile's index and rows are requested before the
  // query prologue, under its loads: they depend only on the item's bounds).
  TileGather gather(p, ib, tid - 128);
  const int ntiles = gather.ntiles;
  if (wgi == 1) {
    gather.fetch_index(0);
    gather.load_tile(0);
    gather.fetch_index(1);
  }

  // ---- Queries -> float16 into the swizzled Q block: head r = tid / 4, 8-column groups part + 4k (k < 18). All
  // 256 threads.
  query_prologue<4>(p, ib.b, h0 + (tid >> 2), tid >> 2, tid & 3, smem + Q_OFF, CHUNK, scales, row_c, row_k);
  fence_async_smem();
  __syncthreads();
  TRACE(8)

  const int r0 = 16 * warp + g;  // this thread's accumulator rows: r0 and r0 + 8
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m_i[2] = {-INFINITY, -INFINITY};  // warpgroup 0: the reference maxima of rows r0, r0 + 8 (base 2)
  float l_i[2] = {0.f, 0.f};              // warpgroup 0: this thread's share of the row sums

  if (wgi == 1) {
    // ================= warpgroup 1: gather and convert the tiles; O[:, 256:512] += P V =================
    if (ntiles > 0) gather.convert_tile(smem + K_OFF, 0);
    if (ntiles > 1) {
      gather.load_tile(1);
      gather.fetch_index(2);
      gather.convert_tile(smem + K_OFF, 1);
    }
    if (ntiles > 2) {
      gather.load_tile(2);
      gather.fetch_index(3);
    }
    TRACE(10)
    for (int it = 0; it < ntiles; ++it) {
      bar_sync<NT>(P_READY);  // P of tile it and its rescale factors are in shared memory
      TRACE(0)
      const float a0 = s_alpha[r0], a1 = s_alpha[r0 + 8];
      if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) {
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          o[4 * j + 0] *= a0;
          o[4 * j + 1] *= a0;
          o[4 * j + 2] *= a1;
          o[4 * j + 3] *= a1;
        }
      }
      const uint64_t vb0 = gmma_desc(base + K_OFF + (it & 1) * TILE + 4 * CHUNK, CHUNK, 1024);
      // P into registers (ldmatrix: the generic proxy, so warpgroup 0 needs no proxy fence), P's buffer released
      // at once, then O[:, 256:512] += P V with A from registers.
      uint32_t pf[4][4];
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const int mi = lane >> 3;
        const uint32_t addr = base + P_OFF + swz(16 * warp + (lane & 7) + 8 * (mi & 1), 2 * ks + (mi >> 1));
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(pf[ks][0]), "=r"(pf[ks][1]), "=r"(pf[ks][2]), "=r"(pf[ks][3])
                     : "r"(addr));
      }
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) pin(pf[ks]);
      if (it + 1 < ntiles) bar_arrive(P_FREE);
      pin(o);
      wg_fence();
#pragma unroll
      for (int ks = 0; ks < BN / 16; ++ks) wgmma_m64n256_rs<1>(o, pf[ks], vb0 + ((ks * 2048) >> 4), 1);
      wg_commit();
      wg_wait0();
      pin(o);
      TRACE(1)
      if (it + 2 < ntiles) {
        bar_sync<NT>((it & 1) ? K_FREE1 : K_FREE0);  // warpgroup 0 is done with buffer it % 2
        TRACE(2)
        gather.convert_tile(smem + K_OFF, it & 1);  // tile it + 2
        TRACE(3)
        if (it + 3 < ntiles) {
          gather.load_tile(it + 3);
          gather.fetch_index(it + 4);
        }
        TRACE(4)
      }
    }
  } else {
    // ================= warpgroup 0: scores, softmax, O[:, 0:256] += P V =================
    const uint64_t qa0 = gmma_desc(base + Q_OFF, 16, 1024);
    const float rc0 = row_c[r0], rc1 = row_c[r0 + 8], rk0 = row_k[r0], rk1 = row_k[r0 + 8];
    int row_seen[2];  // MULTI: the tokens of the chunk rows r0 and r0 + 8 may see (their token's causal limit)
    if constexpr (MULTI) {
#pragma unroll
      for (int row = 0; row < 2; ++row) row_seen[row] = row_tokens(p, ib, h0 + r0 + 8 * row);
    }
    for (int it = 0; it < ntiles; ++it) {
      const uint32_t kbuf = base + K_OFF + (it & 1) * TILE;
      bar_sync<NT>((it & 1) ? K_READY1 : K_READY0);
      TRACE(0)
      float sn[32], sr[32];
      const uint64_t kb0 = gmma_desc(kbuf, 16, 1024);
      wg_fence();
#pragma unroll
      for (int kc = 0; kc < NCHUNK; ++kc) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          // k-step (kc, kk) starts kc * CHUNK + kk * 32 bytes further: the start address field counts 16-byte
          // units and shared addresses stay below 2^18, so adding to it never carries out.
          const uint32_t step = (kc * CHUNK + kk * 32) >> 4;
          if (kc < 8)
            wgmma_m64n64_ss<0>(sn, qa0 + step, kb0 + step, kc + kk > 0);
          else
            wgmma_m64n64_ss<0>(sr, qa0 + step, kb0 + step, kk > 0);
        }
      }
      wg_commit();
      wg_wait0();
      pin(sn);
      pin(sr);
      TRACE(1)

      // Logits (base 2), masked past the chunk (and, MULTI, past each row's causal limit); row maxima over the quad
      // (a quad holds whole rows).
      const int live = (int)min((long long)BN, hi - (lo + (long long)it * BN));
      int live_row[2] = {live, live};
      if constexpr (MULTI) {
#pragma unroll
        for (int row = 0; row < 2; ++row) live_row[row] = min(live, row_seen[row] - it * BN);
      }
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = e >> 1;
          float x = row ? sn[4 * j + e] * rc1 + sr[4 * j + e] * rk1 : sn[4 * j + e] * rc0 + sr[4 * j + e] * rk0;
          if (8 * j + 2 * c + (e & 1) >= (MULTI ? live_row[row] : live)) x = -INFINITY;
          sn[4 * j + e] = x;
          mx[row] = fmaxf(mx[row], x);
        }
      }
      float alpha[2], mb[2];  // mb: the rows' exp2 offsets
#pragma unroll
      for (int row = 0; row < 2; ++row) {
        mx[row] = fmaxf(mx[row], __shfl_xor_sync(0xffffffffu, mx[row], 1));
        mx[row] = fmaxf(mx[row], __shfl_xor_sync(0xffffffffu, mx[row], 2));
        // Lazy rescaling: the reference maximum moves only when the tile's maximum exceeds it by more than
        // 2^RESCALE (P <= 2^RESCALE is exact enough in float16 and in float32 sums).
        const float m = mx[row] > m_i[row] + RESCALE ? mx[row] : m_i[row];
        if constexpr (MULTI) {  // a row with no token yet keeps m = -inf: offsets of 0 (P = 0), alpha 1
          mb[row] = exp2_base(m);
          alpha[row] = m == m_i[row] ? 1.f : exp2f(m_i[row] - mb[row]);
        } else {
          mb[row] = m;
          alpha[row] = exp2f(m_i[row] - m);
        }
        m_i[row] = m;
        l_i[row] *= alpha[row];
      }
      // P = 2^(logit - m) in float16: A-fragment registers for k-step ks: {row r0, tokens 16ks + 2c (+1)},
      // {r0 + 8, same}, {r0, 16ks + 8 + 2c (+1)}, {r0 + 8, same} -- the accumulator layout, two n-tiles a k-step.
      uint32_t pr[4][4];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float p0 = exp2f(sn[4 * j + 0] - mb[0]), p1 = exp2f(sn[4 * j + 1] - mb[0]);
        const float p2 = exp2f(sn[4 * j + 2] - mb[1]), p3 = exp2f(sn[4 * j + 3] - mb[1]);
        l_i[0] += p0 + p1;
        l_i[1] += p2 + p3;
        pr[j >> 1][(j & 1) * 2 + 0] = half2_bits(p0, p1);
        pr[j >> 1][(j & 1) * 2 + 1] = half2_bits(p2, p3);
      }
      TRACE(2)
      if (it > 0) bar_sync<NT>(P_FREE);  // warpgroup 1's P V of the previous tile has read P
      TRACE(3)
#pragma unroll
      for (int j = 0; j < 8; ++j) {  // tokens 8 j .. 8 j + 7 are granule j of the swizzled P rows
        *reinterpret_cast<uint32_t*>(smem + P_OFF + swz(r0, j) + 4 * c) = pr[j >> 1][(j & 1) * 2 + 0];
        *reinterpret_cast<uint32_t*>(smem + P_OFF + swz(r0 + 8, j) + 4 * c) = pr[j >> 1][(j & 1) * 2 + 1];
      }
      if (c == 0) {
        s_alpha[r0] = alpha[0];
        s_alpha[r0 + 8] = alpha[1];
      }
      bar_arrive(P_READY);  // warpgroup 1 reads P with ldmatrix (the generic proxy): no proxy fence
      if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          o[4 * j + 0] *= alpha[0];
          o[4 * j + 1] *= alpha[0];
          o[4 * j + 2] *= alpha[1];
          o[4 * j + 3] *= alpha[1];
        }
      }
      const uint64_t vb0 = gmma_desc(kbuf, CHUNK, 1024);
      TRACE(4)
      pin(o);
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) pin(pr[ks]);
      wg_fence();
#pragma unroll
      for (int ks = 0; ks < BN / 16; ++ks) wgmma_m64n256_rs<1>(o, pr[ks], vb0 + ((ks * 2048) >> 4), 1);
      wg_commit();
      wg_wait0();
      pin(o);
      TRACE(5)
      if (it + 2 < ntiles) bar_arrive((it & 1) ? K_FREE1 : K_FREE0);
    }
    // Row sums over the quad, to shared memory for both warpgroups' normalization.
#pragma unroll
    for (int row = 0; row < 2; ++row) {
      l_i[row] += __shfl_xor_sync(0xffffffffu, l_i[row], 1);
      l_i[row] += __shfl_xor_sync(0xffffffffu, l_i[row], 2);
    }
    if (c == 0) {
      s_sum[r0] = l_i[0];
      s_sum[r0 + 8] = l_i[1];
    }
  }

  // ---- Normalize and write; NaN for a chunk that held an out-of-range index.
  const int any_bad = __syncthreads_or(gather.bad);
  float norm[2], lse2[2];
#pragma unroll
  for (int row = 0; row < 2; ++row) {
    float l = s_sum[r0 + 8 * row];
    if (any_bad) l = NAN;
    const bool empty = l == 0.f;
    norm[row] = empty ? 0.f : ckv_scale / l;
    lse2[row] = empty ? -INFINITY : m_i[row] + log2f(l);  // meaningful in warpgroup 0, which writes it
  }
  // Thread (g, c) of warp w holds rows 16 w + g (+ 8) and columns 256 wgi + 8 j + 2 c + {0, 1}.
#pragma unroll
  for (int row = 0; row < 2; ++row) {
    const int h = h0 + r0 + 8 * row;
    if (h >= p.H) continue;
    if (ib.prow < 0) {
      __nv_bfloat16* orow = p.out + (long long)ib.b * p.stride_o_b + (long long)h * p.stride_o_h + 256 * wgi + 2 * c;
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<__nv_bfloat162*>(orow + 8 * j) =
            __floats2bfloat162_rn(o[4 * j + 2 * row] * norm[row], o[4 * j + 2 * row + 1] * norm[row]);
      if (p.write_lse && wgi == 0 && c == 0) p.lse[(long long)ib.b * p.H + h] = lse2[row] * 0.6931471805599453f;
    } else {
      float* prow_o = p.part_o + ((long long)ib.prow * p.H + h) * DC + 256 * wgi + 2 * c;
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<float2*>(prow_o + 8 * j) =
            make_float2(o[4 * j + 2 * row] * norm[row], o[4 * j + 2 * row + 1] * norm[row]);
      if (wgi == 0 && c == 0) p.part_lse[(long long)ib.prow * p.H + h] = lse2[row];
    }
  }
  TRACE(9)
  TRACE_END
}

}  // namespace wg
}  // namespace kvwall_mla

extern "C" {

// Dynamic shared memory per CTA and heads per CTA of the warpgroup kernel.
int kvwall_mla_wgmma_shape(int* smem, int* heads, int* block_n, int* threads) {
  *smem = kvwall_mla::wg::SMEM;
  *heads = kvwall_mla::wg::HEADS;
  *block_n = kvwall_mla::wg::BN;
  *threads = kvwall_mla::wg::NT;
  return 0;
}

// The split kernel for `p` (its q_len picks the instantiation: 1, the decode code, or the multi-token one).
int kvwall_mla_wgmma_split(const kvwall_mla::Params* p, int head_blocks, int items, void* stream) {
  using namespace kvwall_mla::wg;
  return kvwall_mla::hopper::launch(p->q_len > 1 ? mla_wgmma_split_kernel<true> : mla_wgmma_split_kernel<false>,
                                    head_blocks, items, NT, SMEM, stream, p);
}

#ifdef KVWALL_TRACE
// The diagnostic build's phase sums (2 x 16 counters) into `host`; zeroed after reading when `reset`.
int kvwall_mla_trace(unsigned long long* host, int reset) {
  cudaError_t err = cudaMemcpyFromSymbol(host, kvwall_mla::wg::g_trace, sizeof(kvwall_mla::wg::g_trace));
  if (err == cudaSuccess && reset) {
    static const unsigned long long zeros[32] = {};
    err = cudaMemcpyToSymbol(kvwall_mla::wg::g_trace, zeros, sizeof(zeros));
  }
  return (int)err;
}
#endif

}  // extern "C"
