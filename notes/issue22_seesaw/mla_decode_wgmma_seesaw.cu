// EXPLORATORY (issue 22, "Generation 5"): not built, dispatched or imported by the library. A draft for the next
// H200 session to validate and time (notes/issue22_seesaw/run.py); DESIGN.md beside it has the counts.
//
// Fused FP8 MLA decode, split kernel for Hopper (sm_90a), heads on wgmma's M (64 per CTA): the same plan, partial
// outputs, launch parameters and extern "C" entry points as kernels/mla_decode/mla_decode_wgmma.cu, so wgmma.py can
// launch it as a different shared library. What changes is the schedule inside a CTA: FlashMLA's "seesaw" (two
// consumer warpgroups that each own half of O and compute the scores and softmax of alternate tiles) plus a producer
// warpgroup that gathers and converts, 384 threads, one CTA per SM:
//   consumer c (warpgroups 0, 1): owns O[:, 256c : 256c + 256] (128 accumulator registers) and the tiles i = c mod 2:
//     S = Q K^T (36 wgmma m64n64k16, ONE accumulator: the rope/nope scale ratio is folded into the query before it
//     is rounded), the online softmax (lazy rescaling as in the shipped kernel, the reference maximum handed from
//     tile i's owner to tile i + 1's owner through shared memory), P into the tile's own rope chunk (stmatrix; the
//     rope columns are dead once the scores are done), and, strictly in tile order, O_c = O_c alpha_i + P_i V_i[:, c]
//     for every tile: the other consumer's P read by ldmatrix.
//   producer (warpgroup 2, setmaxnreg down): the shipped kernel's gather (16-byte loads into registers, one tile in
//     flight) and conversion into the tile buffer b = i mod 2 (which is always consumer b's).
// A pair of tiles (i even: consumer 0's; i + 1: consumer 1's), each consumer in program order:
//     consumer 0: [READY0] S_i | softmax_i -> SMD0 | P_i V_i[:, 0:256] -> FREE0 | [SMD1] P_{i+1} V_{i+1} -> FREE1
//     consumer 1: [READY1] S_{i+1} | [SMD0] softmax_{i+1} -> SMD1 | P_i V_i[:, 256:] -> FREE0 | P_{i+1} V_{i+1} ->
//                 FREE1
// so S_{i+1} runs under softmax_i and P_i V_i[:, 0:256] under softmax_{i+1} (the tensor pipe: S_i, S_{i+1}, then the
// four P V); tile i's buffer is free two P V products before S_{i+2} needs it, which is when the producer converts
// tile i + 2. (FlashMLA's order; what differs: the P V are applied in tile order, the buffer release is per tile.)
//
// Named barriers (ID: parties, count). Every producer of a phase waits, through the chain named, for the previous
// phase's consumer before it arrives again, so no barrier ever counts two phases' arrivals together:
//   QB 1: the two consumers (256), once: the query block and the softmax state are initialized.
//   READY0/1 2/3: producer arrives (128), consumer b syncs (128): buffer b holds tile i (i = b mod 2). Once per tile.
//   FREE0/1 4/5: both consumers arrive (256), the producer syncs (128): buffer b's tile i is done (both P V halves and
//     the other consumer's read of P_i); only when tile i + 2 exists, which is exactly when the producer waits.
//   SMD0/1 6/7: consumer b arrives (128) after tile i's softmax (i = b mod 2), the other syncs (128). Once per tile.
//   END 8: all 384 (bar.red.or): the producer's out-of-range flag, and each consumer's row sums, before the write.
//   SDONE 9 (KVWALL_SS_ORDER = 1 only): consumer 1 arrives (128) when S_{i+1} is done, consumer 0 syncs (128) before
//     P_i V_i; once per odd tile (consumer 0 syncs iff tile i + 1 exists).
//   SDEAD0 10 (KVWALL_SS_WG_SYNC = 1, the default): consumer 0's own four warps (128, bar.sync), once per own tile,
//     before its stmatrix of P_i. Warp w's P rows overwrite K rope rows (tokens) 16 w .. 16 w + 15, which EVERY
//     warp's S_i wgmma reads as B; each warp's wgmma.wait_group returns on its own (PTX: the groups "committed by
//     the executing threads"), and whether one warp's return implies the other three warps' reads are done is not
//     stated (a wgmma-group is "per warpgroup"; CUTLASS's cluster pipelines assume so). One bar.sync makes it
//     certain. Consumer 1 needs none: its SMD0 bar.sync (count 256 = consumer 0's 128 arrivals + all four of its
//     own warps) already sits between its scores and its stmatrix.
#include <type_traits>

#include "../../kernels/mla_decode/mla_decode_common.cuh"

namespace kvwall_mla {
namespace ss {

constexpr int HEADS = 64;                    // heads per CTA: wgmma's M
constexpr int BN = 64;                       // tokens per tile
constexpr int NT = 384;                      // two consumer warpgroups + one producer
constexpr int CHUNK = 64 * 128;              // 64 rows x 64 float16 columns, 128-byte swizzled: 8 KB
constexpr int NCHUNK = D / 64;               // 9 column chunks per row (8 nope + 1 rope)
constexpr int TILE = NCHUNK * CHUNK;         // 73,728 B: a [64 x 576] float16 tile
constexpr int Q_OFF = 0;                     // the query block [64 heads x 576], float16, 9 swizzled chunks
constexpr int K_OFF = TILE;                  // two converted tiles; buffer b holds tiles i = b mod 2 and, once tile
                                             // i's scores are done, its P [64 heads x 64 tokens] in chunk 8 (rope)
constexpr int F_OFF = 3 * TILE;              // floats: s_m[2][64], s_alpha[2][64], s_l[2][64], s_rc[64]
constexpr int SMEM = F_OFF + 7 * 64 * 4;     // 222,976 B (232,448 allowed per block)
constexpr float RESCALE = 8.f;               // lazy rescaling threshold (log2 units): P stays below 256
constexpr int ROWS = 2;                      // token rows each producer thread gathers per tile (lr, lr + 32)
constexpr int PIECES = D / 64;               // 16-byte pieces per row per thread (a quad of lanes per row)
// setmaxnreg: the CTA is launched with 168 registers per thread (65,536 / 384, rounded down to a multiple of 8);
// the three warpgroups' values must sum to at most 3 x 168 = 504 (an increase beyond what the CTA holds waits
// forever), each a multiple of 8 in [24, 256].
#ifndef KVWALL_SS_RC
#define KVWALL_SS_RC 200
#endif
#ifndef KVWALL_SS_RP
#define KVWALL_SS_RP 104
#endif
constexpr int RC = KVWALL_SS_RC, RP = KVWALL_SS_RP;
// 1: the producer requests the next tile's pieces while it converts this one (before the proxy fence); 0: after
// the tile is published, as the shipped kernel does.
#ifndef KVWALL_SS_EARLY_LOADS
#define KVWALL_SS_EARLY_LOADS 0
#endif
static_assert(2 * RC + RP <= 3 * 168 && RC % 8 == 0 && RP % 8 == 0 && RP >= 24 && RC <= 256, "setmaxnreg budget");
static_assert(SMEM <= 232448, "shared memory per block");
// 1: consumer 0 issues P_i V_i only once consumer 1's S_{i+1} is done (barrier SDONE), so that it runs under
// softmax_{i+1} rather than sharing the tensor pipe with S_{i+1} (which would leave the pipe idle during
// softmax_{i+1} if the warpgroups' wgmma interleave rather than queue in order: not known; both are timed).
#ifndef KVWALL_SS_ORDER
#define KVWALL_SS_ORDER 0
#endif
// 1 (default): barrier SDEAD0 (above); 0: without it (relies on the four warps' wgmma completing together).
#ifndef KVWALL_SS_WG_SYNC
#define KVWALL_SS_WG_SYNC 1
#endif
enum Barrier {
  QB = 1, READY0 = 2, READY1 = 3, FREE0 = 4, FREE1 = 5, SMD0 = 6, SMD1 = 7, END = 8, SDONE = 9, SDEAD0 = 10
};

// ---- KVWALL_TRACE (diagnostic build): lane 0 of each warpgroup's first warp sums clock64() deltas per phase in
// shared memory; each CTA adds them to g_trace[warpgroup][phase] (slot 14 counts CTAs, 15 tiles).
#ifdef KVWALL_TRACE
__device__ unsigned long long g_trace[3][16];
#define TRACE_DECL __shared__ unsigned long long s_tr[3][17];
#define TRACE_INIT                                                  \
  if ((tid & 127) == 0) {                                           \
    for (int k_ = 0; k_ < 16; ++k_) s_tr[tid >> 7][k_] = 0;          \
    s_tr[tid >> 7][16] = clock64();                                  \
  }
#define TRACE(k)                                                    \
  if ((tid & 127) == 0) {                                           \
    const unsigned long long now_ = clock64();                      \
    s_tr[tid >> 7][k] += now_ - s_tr[tid >> 7][16];                  \
    s_tr[tid >> 7][16] = now_;                                       \
  }
#define TRACE_END                                                   \
  if ((tid & 127) == 0) {                                           \
    for (int k_ = 0; k_ < 14; ++k_) atomicAdd(&g_trace[tid >> 7][k_], s_tr[tid >> 7][k_]); \
    atomicAdd(&g_trace[tid >> 7][14], 1ull);                         \
    atomicAdd(&g_trace[tid >> 7][15], (unsigned long long)ntiles);   \
  }
#else
#define TRACE_DECL
#define TRACE_INIT
#define TRACE(k)
#define TRACE_END
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
// Ordinary shared-memory stores that wgmma (the async proxy) reads next: each writing thread fences, then a barrier.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
// Named barriers with an explicit thread count: `sync` waits for COUNT arrivals (its own included), `arrive` counts
// this thread and goes on.
template <int COUNT>
__device__ __forceinline__ void bar_sync(int id) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(COUNT) : "memory"); }
template <int COUNT>
__device__ __forceinline__ void bar_arrive(int id) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(COUNT) : "memory"); }
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
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_B));
}

template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n256_rs(float (&d)[128], const uint32_t (&a)[4], uint64_t desc_b, int accumulate) {
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
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(TRANS_B));
}

// O (one consumer's [64 x 256] accumulators, m64n256 layout) and the row sums times the rows' factors, when any row
// of the warp has a factor other than 1 (lazy rescaling: rare after the first tile).
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

__global__ void __launch_bounds__(NT, 1) mla_wgmma_seesaw_kernel(const Params p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  TRACE_DECL
  float* s_m = reinterpret_cast<float*>(smem + F_OFF);  // [2][64]: reference maximum after tile i, in slot i % 2
  float* s_alpha = s_m + 128;                           // [2][64]: tile i's rescale factor, slot i % 2
  float* s_l = s_alpha + 128;                           // [2][64]: consumer c's row sums, at the end
  float* s_rc = s_l + 128;                              // [64]: per head, the score scale (base 2)
  const uint32_t base = smem_addr(smem);
  if (base & 1023) __trap();  // the swizzle needs 1024-byte aligned chunks

  const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31;
  TRACE_INIT
  const int g = lane >> 2, c4 = lane & 3;
  // The warpgroup index through a shuffle from lane 0: warp-uniform, so descriptors stay in uniform registers.
  const int wgi = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const int h0 = blockIdx.x * HEADS;
  const ItemBounds ib = item_bounds(p, blockIdx.y);
  const long long start = ib.start, lo = ib.lo, hi = ib.hi;
  const float ckv_scale = p.scale_from_ptr ? __ldg(p.ckv_scale_ptr) : p.ckv_scale_val;
  const float kpe_scale = p.scale_from_ptr ? __ldg(p.kpe_scale_ptr) : p.kpe_scale_val;
  const int ntiles = (int)((hi - lo + BN - 1) / BN);

  if (wgi == 2) {
    // ================= producer: gather tile i into registers, convert it into buffer i % 2 =================
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(RP) : "memory");
    const int page_shift = (p.page & (p.page - 1)) == 0 ? __ffs(p.page) - 1 : -1;
    int bad = 0;
    // Thread (row lr, quad lane lq) holds pieces lq + 4k (k < 9) of token rows lr and lr + 32: k < 8 from ckv
    // (latent columns 64k + 16 lq ..), k = 8 from kpe (rope columns 16 lq ..); piece k lands in column chunk k,
    // granules 2 lq and 2 lq + 1. Rows past the chunk are zeros (their P is 0, and 0 x garbage may be NaN).
    const int t = tid - 256, lr = t >> 2, lq = t & 3;
    uint4 raw[ROWS][PIECES];
    int entry_lo[ROWS], entry_hi[ROWS];  // page-table entries of the next tile to load, as loaded (a tile ahead)
    // Token arithmetic in 32 bits (token positions are below 2^31); the request's page-table row as a pointer.
    // (Broadcast from lane 0: known warp-uniform, they can live in uniform registers.)
    const int lo32 = __shfl_sync(0xffffffffu, (int)lo, 0), len = __shfl_sync(0xffffffffu, (int)(hi - lo), 0);
    const int start_lo = __shfl_sync(0xffffffffu, (int)start, 0), start_hi = __shfl_sync(0xffffffffu, (int)(start >> 32), 0);
    const long long start_u = (long long)(((unsigned long long)(unsigned)start_hi << 32) | (unsigned)start_lo);
    const int* idx32 = static_cast<const int*>(p.indices) + start_u;
    const long long* idx64 = static_cast<const long long*>(p.indices) + start_u;
    // Pages of a power-of-two size (the usual 1 and 64) split a token by shifts; others by a multiply-high with
    // pinv = floor((2^32 - 1) / page), whose quotient is the true one or one less (tokens < 2^31), fixed up once.
    const unsigned pinv = page_shift >= 0 ? 0u : (unsigned)(0xFFFFFFFFull / (unsigned)p.page);
    auto split = [&](int tt, int& pg, int& in_page) {
      if (page_shift >= 0) {
        pg = tt >> page_shift;
        in_page = tt & (p.page - 1);
      } else {
        unsigned q = __umulhi((unsigned)tt, pinv), r = (unsigned)tt - q * (unsigned)p.page;
        if (r >= (unsigned)p.page) {
          ++q;
          r -= (unsigned)p.page;
        }
        pg = (int)q;
        in_page = (int)r;
      }
    };
    auto fetch_index = [&](int tile) {
#pragma unroll
      for (int rr = 0; rr < ROWS; ++rr) {
        const int rel = tile * BN + lr + 32 * rr;  // row of the item; live rows are < len (so tile < ntiles)
        entry_lo[rr] = entry_hi[rr] = 0;
        if (rel < len) {
          int i, in_page;
          split(lo32 + rel, i, in_page);
          if (p.indices64)
            asm volatile("ld.global.nc.v2.s32 {%0, %1}, [%2];\n" : "=r"(entry_lo[rr]), "=r"(entry_hi[rr]) : "l"(idx64 + i));
          else
            asm volatile("ld.global.nc.s32 %0, [%1];\n" : "=r"(entry_lo[rr]) : "l"(idx32 + i));
        }
      }
    };
    // Row rr of `tile` (its entry fetched): the slot (cache row) it reads, -1 when the row is past the chunk.
    auto row_slot = [&](int tile, int rr) -> long long {
      const int rel = tile * BN + lr + 32 * rr;
      const bool live = rel < len;
      long long e = p.indices64 ? (long long)(((unsigned long long)(unsigned)entry_hi[rr] << 32) | (unsigned)entry_lo[rr])
                                : (long long)entry_lo[rr];
      if (live && (e < 0 || e >= p.num_units)) {
        bad = 1;
        e = 0;
      }
      int pg, in_page;
      split(lo32 + rel, pg, in_page);
      return live ? e * p.page + in_page : -1ll;
    };
    // Row addresses of this lane's pieces (kpe piece and ckv piece 0; ckv piece k is 4k uint4 further: an
    // immediate offset of the load), or null past the chunk, whose pieces are zeros.
    auto kpe_src = [&](long long slot) {
      return slot < 0 ? nullptr : reinterpret_cast<const uint4*>(p.kpe + slot * p.stride_kpe) + lq;
    };
    auto ckv_src = [&](long long slot) {
      return slot < 0 ? nullptr : reinterpret_cast<const uint4*>(p.ckv + slot * p.stride_ckv) + lq;
    };
    auto ld16 = [](const uint4* q) { return q ? __ldg(q) : make_uint4(0, 0, 0, 0); };
    // This lane's two 16-byte granules of a row lr (+ 32): swz(lr, 2 lq) and swz(lr, 2 lq + 1) = the first ^ 16.
    const uint32_t so0 = swz(lr, 2 * lq), so1 = so0 ^ 16u;
    // Tile `next`'s row rr into `raw` (its entry fetched a tile earlier).
    auto load_row = [&](int next, int rr) {
      const long long slot = row_slot(next, rr);
      const uint4* sk = kpe_src(slot);
      const uint4* sc = ckv_src(slot);
#pragma unroll
      for (int k = 0; k < PIECES; ++k) raw[rr][k] = ld16(k < 8 ? (sc ? sc + 4 * k : nullptr) : sk);
    };
    // Convert the tile in `raw` into buffer `buf`, publish it (proxy fence, READY), and request tile `next` into
    // `raw`. KVWALL_SS_EARLY_LOADS = 1 requests each piece of `next` as soon as its registers are converted, i.e.
    // before the fence: earlier loads, unless the fence (MEMBAR.ALL.CTA in SASS) waits for them (not known: the
    // device script times both builds).
    auto convert_reload = [&](int buf, int next) {
      uint8_t* dst = smem + K_OFF + buf * TILE;
#pragma unroll
      for (int rr = 0; rr < ROWS; ++rr) {
        [[maybe_unused]] const long long slot = KVWALL_SS_EARLY_LOADS ? row_slot(next, rr) : 0;
        [[maybe_unused]] const uint4* sk = KVWALL_SS_EARLY_LOADS ? kpe_src(slot) : nullptr;
        [[maybe_unused]] const uint4* sc = KVWALL_SS_EARLY_LOADS ? ckv_src(slot) : nullptr;
#pragma unroll
        for (int kk = 0; kk < PIECES; ++kk) {
          const int k = (kk + PIECES - 1) % PIECES;  // the kpe piece first: its address dies first
          uint32_t f[8];
          e4m3x4_to_f16x2x2(raw[rr][k].x, f[0], f[1]);
          e4m3x4_to_f16x2x2(raw[rr][k].y, f[2], f[3]);
          e4m3x4_to_f16x2x2(raw[rr][k].z, f[4], f[5]);
          e4m3x4_to_f16x2x2(raw[rr][k].w, f[6], f[7]);
          uint8_t* chunk = dst + k * CHUNK + rr * 32 * 128;  // row lr + 32 rr: the same swizzle phase as lr
          *reinterpret_cast<uint4*>(chunk + so0) = make_uint4(f[0], f[1], f[2], f[3]);
          *reinterpret_cast<uint4*>(chunk + so1) = make_uint4(f[4], f[5], f[6], f[7]);
          if (KVWALL_SS_EARLY_LOADS) raw[rr][k] = ld16(k < 8 ? (sc ? sc + 4 * k : nullptr) : sk);
        }
      }
      fence_async_smem();
      bar_arrive<256>(buf ? READY1 : READY0);
      if (!KVWALL_SS_EARLY_LOADS) {
#pragma unroll
        for (int rr = 0; rr < ROWS; ++rr) load_row(next, rr);
      }
    };

    fetch_index(0);
#pragma unroll
    for (int rr = 0; rr < ROWS; ++rr) load_row(0, rr);
    fetch_index(1);
    TRACE(10)
    for (int i = 0; i < ntiles; ++i) {
      if (i >= 2) bar_sync<384>((i & 1) ? FREE1 : FREE0);  // both consumers are done with tile i - 2
      TRACE(0)
      convert_reload(i & 1, i + 1);                          // tile i into buffer i % 2; tile i + 1 requested
      TRACE(1)
      fetch_index(i + 2);
      TRACE(2)
    }
    bar_end_or(bad);
    TRACE_END
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
  bar_sync<256>(QB);
  TRACE(8)

  const int r0 = 16 * warp + g;  // this thread's accumulator rows: r0 and r0 + 8
  const int len = (int)(hi - lo);  // tokens of the item (below 2^31)
  // ldmatrix / stmatrix rows of this lane: matrix mi = lane / 8 of k-step ks is rows 16 warp + 8 (mi & 1) + 0..7,
  // granule (8 tokens) 2 ks + (mi >> 1) of a P chunk; offsets within the chunk.
  // Recomputed at each use from %laneid (volatile: not hoisted out of the loop, where it would hold 4 registers).
  auto pm_off = [&](int ks) -> uint32_t {
    int ln;
    asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(ln));
    const int mi = ln >> 3, prow = 16 * warp + (ln & 7) + 8 * (mi & 1);
    return swz(prow, 2 * ks + (mi >> 1));
  };

  // The consumer's loop, compiled once per consumer (C = 0, 1) so that its buffers, barriers and shared-memory
  // slots are constants.
  auto consume = [&](auto cc) {
    constexpr int C = decltype(cc)::value;
    constexpr int BAR_READY = C ? READY1 : READY0, BAR_FREE_OWN = C ? FREE1 : FREE0, BAR_FREE_OTH = C ? FREE0 : FREE1;
    constexpr int BAR_SMD_OWN = C ? SMD1 : SMD0, BAR_SMD_OTH = C ? SMD0 : SMD1;
    constexpr uint32_t OWN = K_OFF + C * TILE, OTH = K_OFF + (1 - C) * TILE;  // byte offsets of the two buffers
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float l_i[2] = {0.f, 0.f};  // this thread's share of the row sums of this consumer's own tiles
    const uint64_t qa0 = gmma_desc(base + Q_OFF, 16, 1024);                   // A: Q, K-major
    const uint64_t kb0 = gmma_desc(base + OWN, 16, 1024);                     // B of the scores: K, K-major
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
      for (int ks = 0; ks < BN / 16; ++ks) wgmma_m64n256_rs<1>(o, pf[ks], vb_oth + ((ks * 2048) >> 4), 1);
      wg_commit();
      wg_wait0();
      pin(o);
      if (j + 2 < ntiles) bar_arrive<384>(BAR_FREE_OTH);  // this consumer is done with tile j (P and V)
    };
    // This consumer's tile i, first half: S_i = Q K_i^T (36 wgmma, one accumulator).
    auto scores = [&](float (&s)[32]) {
      bar_sync<256>(BAR_READY);  // buffer C holds tile i
      TRACE(0)
      wg_fence();
#pragma unroll
      for (int kc = 0; kc < NCHUNK; ++kc) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint32_t step = (kc * CHUNK + kk * 32) >> 4;  // start address field in 16-byte units: no carry
          wgmma_m64n64_ss<0>(s, qa0 + step, kb0 + step, kc + kk > 0);
        }
      }
      wg_commit();
      wg_wait0();
      pin(s);
      TRACE(1)
    };
    // Second half: the softmax of tile i against m_{i-1} (shared-memory slot 1 - C; the caller has synced SMD_OTH
    // for tile i - 1, or i = 0), P_i / m_i / alpha_i published (SMD_OWN), P_i kept in registers for pv_own.
    auto softmax = [&](int i, float (&s)[32], uint32_t (&pr)[4][4], float (&alpha)[2], float (&ps)[2]) {
      // Logits (base 2), masked past the chunk; row maxima over the quad (a quad holds whole rows).
      const int live = min(BN, len - i * BN);
      const float rc0 = s_rc[r0], rc1 = s_rc[r0 + 8];  // read per tile (two loads) rather than held
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = e >> 1;
          float x = s[4 * j + e] * (row ? rc1 : rc0);
          if (8 * j + 2 * c4 + (e & 1) >= live) x = -INFINITY;
          s[4 * j + e] = x;
          mx[row] = fmaxf(mx[row], x);
        }
      }
      const float mp[2] = {s_m[64 * (1 - C) + r0], s_m[64 * (1 - C) + r0 + 8]};  // m_{i-1} (-inf before tile 0)
      float m_new[2];
#pragma unroll
      for (int row = 0; row < 2; ++row) {
        mx[row] = fmaxf(mx[row], __shfl_xor_sync(0xffffffffu, mx[row], 1));
        mx[row] = fmaxf(mx[row], __shfl_xor_sync(0xffffffffu, mx[row], 2));
        // Lazy rescaling (the shipped kernel's rule): the reference moves only when the tile's maximum exceeds it
        // by more than 2^RESCALE.
        m_new[row] = mx[row] > mp[row] + RESCALE ? mx[row] : mp[row];
        alpha[row] = exp2f(mp[row] - m_new[row]);
      }
      // P = 2^(logit - m) in float16, A-fragment registers of k-step ks: {row r0, tokens 16ks + 2c (+1)},
      // {r0 + 8, same}, {r0, 16ks + 8 + 2c (+1)}, {r0 + 8, same}.
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
      // P into chunk 8 of this buffer (the rope columns: the scores, their only reader, are done) by stmatrix, in
      // the fragment order the other consumer's ldmatrix reads back; the reference and the factor beside it.
      // "Done" for all four warps of this warpgroup, not just this one (SDEAD0; consumer 1 has passed SMD0's sync).
      if constexpr (C == 0 && KVWALL_SS_WG_SYNC) bar_sync<128>(SDEAD0);
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) stsm_x4(base + OWN + 8 * CHUNK + pm_off(ks), pr[ks]);
      if (c4 == 0) {
        s_m[64 * C + r0] = m_new[0];
        s_m[64 * C + r0 + 8] = m_new[1];
        s_alpha[64 * C + r0] = alpha[0];
        s_alpha[64 * C + r0 + 8] = alpha[1];
      }
      bar_arrive<256>(BAR_SMD_OWN);  // the other consumer reads P by ldmatrix (the generic proxy): no proxy fence
      TRACE(2)
    };
    // O_C = O_C alpha_i + P_i V_i[:, 256C ..] with P_i from registers (or, RELOAD, read back from shared memory
    // by ldmatrix: consumer 1 applies the other tile's P first, and 16 more live registers would not fit);
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
      for (int ks = 0; ks < BN / 16; ++ks) wgmma_m64n256_rs<1>(o, pr[ks], vb_own + ((ks * 2048) >> 4), 1);
      wg_commit();
      wg_wait0();
      pin(o);
      if (i + 2 < ntiles) bar_arrive<384>(BAR_FREE_OWN);  // this consumer is done with tile i
    };

    // The seesaw (a pair of tiles i = 2k, 2k + 1; consumer 0 owns i, consumer 1 owns i + 1), each consumer applying
    // every tile to its half of O in tile order:
    //   consumer 0: S_i, softmax_i, P_i V_i,                          [sync SMD1: tile i + 1] P_{i+1} V_{i+1}
    //   consumer 1: S_{i+1}, [sync SMD0: tile i] softmax_{i+1},        P_i V_i,                P_{i+1} V_{i+1}
    // so S_{i+1} runs under softmax_i, and P_i V_i (consumer 0) under softmax_{i+1}; the buffer of tile i is free
    // after both P_i V_i, a pair's last two products ahead of S_{i+2}: the producer converts tile i + 2 meanwhile.
    if constexpr (C == 0) {
      for (int i = 0; i < ntiles; i += 2) {
        float s[32], alpha[2], ps[2];
        uint32_t pr[4][4];
        scores(s);
        softmax(i, s, pr, alpha, ps);
        if (KVWALL_SS_ORDER && i + 1 < ntiles) bar_sync<256>(SDONE);  // consumer 1's S_{i+1} is done
        pv_own(i, pr, alpha, ps, std::false_type{});
        TRACE(3)
        if (i + 1 < ntiles) {
          bar_sync<256>(BAR_SMD_OTH);  // tile i + 1's softmax is done: m, alpha, P in shared memory
          TRACE(4)
          pv_other(i + 1);
          TRACE(5)
        }
      }
    } else {
      for (int i = 1; i < ntiles; i += 2) {
        float s[32], alpha[2], ps[2];
        uint32_t pr[4][4];
        scores(s);
        if (KVWALL_SS_ORDER) bar_arrive<256>(SDONE);  // once per odd tile i: consumer 0 syncs it for tile i - 1
        bar_sync<256>(BAR_SMD_OTH);  // tile i - 1's softmax is done: m_{i-1} for this softmax, alpha and P for P V
        TRACE(4)
        softmax(i, s, pr, alpha, ps);
        pv_other(i - 1);
        TRACE(5)
        pv_own(i, pr, alpha, ps, std::true_type{});
        TRACE(3)
      }
      if (ntiles & 1) {  // the last tile, ntiles - 1, is consumer 0's
        bar_sync<256>(BAR_SMD_OTH);
        TRACE(4)
        pv_other(ntiles - 1);
        TRACE(5)
      }
    }

    // Row sums over the quad, each consumer's into shared memory; the END barrier publishes them with the flag.
#pragma unroll
    for (int row = 0; row < 2; ++row) {
      l_i[row] += __shfl_xor_sync(0xffffffffu, l_i[row], 1);
      l_i[row] += __shfl_xor_sync(0xffffffffu, l_i[row], 2);
    }
    if (c4 == 0) {
      s_l[64 * C + r0] = l_i[0];
      s_l[64 * C + r0 + 8] = l_i[1];
    }
    const int any_bad = bar_end_or(0);

    // ---- Normalize and write; NaN for a chunk that held an out-of-range index.
    const float* m_fin = s_m + 64 * ((ntiles - 1) & 1);  // the reference after the last tile (read only if l > 0)
    float norm[2], lse2[2];
#pragma unroll
    for (int row = 0; row < 2; ++row) {
      float l = s_l[r0 + 8 * row] + s_l[64 + r0 + 8 * row];
      if (any_bad) l = NAN;
      const bool empty = l == 0.f;
      norm[row] = empty ? 0.f : ckv_scale / l;
      lse2[row] = empty ? -INFINITY : m_fin[r0 + 8 * row] + log2f(l);
    }
    // Thread (g, c4) of warp w holds rows 16 w + g (+ 8) and columns 256 C + 8 j + 2 c4 + {0, 1}.
#pragma unroll
    for (int row = 0; row < 2; ++row) {
      const int h = h0 + r0 + 8 * row;
      if (h >= p.H) continue;
      if (ib.prow < 0) {
        __nv_bfloat16* orow = p.out + (long long)ib.b * p.stride_o_b + (long long)h * p.stride_o_h + 256 * C + 2 * c4;
#pragma unroll
        for (int j = 0; j < 32; ++j)
          *reinterpret_cast<__nv_bfloat162*>(orow + 8 * j) =
              __floats2bfloat162_rn(o[4 * j + 2 * row] * norm[row], o[4 * j + 2 * row + 1] * norm[row]);
        if (p.write_lse && C == 0 && c4 == 0) p.lse[(long long)ib.b * p.H + h] = lse2[row] * 0.6931471805599453f;
      } else {
        float* prow_o = p.part_o + ((long long)ib.prow * p.H + h) * DC + 256 * C + 2 * c4;
#pragma unroll
        for (int j = 0; j < 32; ++j)
          *reinterpret_cast<float2*>(prow_o + 8 * j) =
              make_float2(o[4 * j + 2 * row] * norm[row], o[4 * j + 2 * row + 1] * norm[row]);
        if (C == 0 && c4 == 0) p.part_lse[(long long)ib.prow * p.H + h] = lse2[row];
      }
    }
  };
  if (wgi == 0)
    consume(std::integral_constant<int, 0>{});
  else
    consume(std::integral_constant<int, 1>{});
  TRACE(9)
  TRACE_END
}

}  // namespace ss
}  // namespace kvwall_mla

extern "C" {

int kvwall_mla_params_size() { return (int)sizeof(kvwall_mla::Params); }

// Dynamic shared memory, heads per CTA, tokens per tile and threads of this kernel (wgmma.py's _bind compares them
// with its constants: the seesaw's are SMEM 222,976 and 384 threads).
int kvwall_mla_wgmma_shape(int* smem, int* heads, int* block_n, int* threads) {
  *smem = kvwall_mla::ss::SMEM;
  *heads = kvwall_mla::ss::HEADS;
  *block_n = kvwall_mla::ss::BN;
  *threads = kvwall_mla::ss::NT;
  return 0;
}

int kvwall_mla_wgmma_split(const kvwall_mla::Params* p, int head_blocks, int items, void* stream) {
  if (items == 0 || head_blocks == 0) return 0;
  auto kernel = kvwall_mla::ss::mla_wgmma_seesaw_kernel;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kvwall_mla::ss::SMEM);
  if (err != cudaSuccess) return (int)err;
  kernel<<<dim3(head_blocks, items), kvwall_mla::ss::NT, kvwall_mla::ss::SMEM, (cudaStream_t)stream>>>(*p);
  return (int)cudaGetLastError();
}

#ifdef KVWALL_TRACE
// The diagnostic build's phase sums (3 x 16 counters: consumer 0, consumer 1, producer) into `host`; zeroed after
// reading when `reset`.
int kvwall_mla_trace(unsigned long long* host, int reset) {
  cudaError_t err = cudaMemcpyFromSymbol(host, kvwall_mla::ss::g_trace, sizeof(kvwall_mla::ss::g_trace));
  if (err == cudaSuccess && reset) {
    static const unsigned long long zeros[48] = {};
    err = cudaMemcpyToSymbol(kvwall_mla::ss::g_trace, zeros, sizeof(zeros));
  }
  return (int)err;
}
#endif

const char* kvwall_mla_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

}  // extern "C"
