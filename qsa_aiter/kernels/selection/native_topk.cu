// native_topk.cu -- exact, deterministic block top-k for sparse-attention block selection.
//
// Contract (per row r of fp32 logits[rows, columns], row stride ld, last dim contiguous):
//   n = clamp(visible[r], 0, columns)
//   out[r, :] = the K best columns of [0, n) ranked by (-score, column), listed in ASCENDING
//               column order, then -1 padding.  If n <= K: 0..n-1 then -1, scores not read.
//   Columns >= n are never read.  -inf ranks last but counts; -0.0 == +0.0; no NaN in [0, n).
//   out is int32 [rows, K], rows K apart.
//   With tokens != nullptr the launch also expands each row's groups to token indices (expand_row, the
//   contract of qsa_expand_block_indices) into tokens[r, 0:width], rows tok_ld apart.
//
// Method: radix select on order-preserving 32-bit keys
//   key(x) = bits(x) == 0x80000000 ? 0x80000000 : (sign ? ~bits : bits | 0x80000000)
// with digits of 11 + 11 + 10 bits (shared-memory histograms of 2048/2048/1024 bins; the
// threshold bin is found inside the kernel with a block-wide suffix scan, select_bin).
// The result is a threshold key T and a count e: a column is selected iff
//   key > T, or key == T and it is among the first e columns (in column order) with key == T.
// If after a pass the whole threshold bin is taken, we stop early with T = lowest key of the
// bin and e = "all" (0xFFFFFFFF).  Atomics only ever count or OR bits (histograms, bitmap
// marks, candidate slots whose order never reaches the output), so the output is bitwise
// deterministic.  No host sync: `visible` is read on device, so a CUDA graph replays
// correctly after `visible` is rewritten in place.
//
// Per row (or per cluster chunk) the stages are:
//   pass 1   the only read of the row from global memory.  On sm_90 (TOPK_BULK) the row is
//            streamed into shared memory with 1-D bulk copies (cp.async.bulk + one mbarrier per
//            piece, up to 16 pieces) and converted to keys in place while later pieces are in
//            flight; otherwise 4 float4 loads per thread are issued before use.  Histogram of
//            the top 11 bits with plain shared atomics.
//   fast path: when the threshold bin b0 holds <= cand_cap keys,
//     pass 2 reads every cached key once: digit > b0 -> set its bit in the column bitmap SB;
//            digit == b0 -> append its column (u16) to the candidate list (a quad at a time: one OR
//            into SB and one candidate-counter update per quad);
//     passes 3/4 histogram the candidates only; candidates with key > T are marked in SB,
//            ties (key == T) in a tie bitmap TB; the first e ties in column order move to SB
//            via a block prefix popcount over TB;
//     output: a block prefix popcount over SB gives each selected column its slot, so the
//            columns come out in ascending order with no sort.
//   full-scan path (fallback when the threshold bin is too big, e.g. heavy ties, or the row
//     is not cached): passes 2/3 histogram the whole cached row (or re-read global memory);
//     a final ordered pass over the row writes the selected columns using block-wide
//     exclusive scans of packed per-thread counts (eq << 16 | gt).
//
// The scorer's histogram: with histogram != nullptr (int32 [rows, 2048], row r counting the top 11 bits of the
// keys of logits[r, 0:n), kernels/scoring/histogram.py) pass 1 only caches the keys and takes its histogram from
// there (a cluster: the whole row's, so the CTAs exchange none).
//
// Kernels (all extern "C", launched with dynamic shared memory; the layouts and the plan that
// sizes them are mirrored in native_topk.py beside this file):
//   topk_rows_256 / topk_rows_512      one CTA per row (many rows).
//       cached mode:  [H 2048 | scan 128 | res 8 | mbarriers 32 | SB nwcap | cand cand_cap/2 |
//                      keys round4(columns)] words, nwcap = round4(ceil(columns/32)).
//                     Candidate columns are u16 and the tie bitmap reuses H: a cached row holds
//                     at most 65536 columns.
//       uncached mode (rows too long for shared memory): later passes re-read global memory
//                     (mostly L2 hits); keys of the threshold bin are compacted into a shared
//                     buffer when they fit, so pass 3 reads shared memory.
//   topk_cluster{2,4,8,16}_512 (sm_90+, TOPK_CLUSTERS)  one thread-block cluster of CL CTAs per
//       row for few long rows.  Each CTA caches its chunk (round4(ceil(n/CL)) keys) and builds
//       local histograms, then pushes its non-zero bins into the cluster-sum histogram of every
//       CTA with remote reductions (red.shared::cluster, fire-and-forget, no remote loads); after
//       a cluster barrier every CTA finds the same threshold bin from its own copy.  Per-CTA
//       counts of (key > T, key == T) are pushed to the higher ranks the same way, giving each
//       CTA its output offset and its rank among ties.
//       layout: [H | S0 | S1 | S2 | scan | res | base | mbarriers] (7344 words) | SB | cand | keys.
//       The cluster size is fixed at compile time (__cluster_dims__), so a plain launch works.
//       Cluster-16 is a non-portable size: the launcher sets
//       CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED before launching it.
//
// Portability: every fact of the vendor and target (the warp width, checked against -DTOPK_WARP_SIZE; shuffles and
// votes; launch bounds; whether clusters and bulk copies exist: CUDA sm_90+ only, TOPK_CLUSTERS / TOPK_BULK) is in
// native_compat.h, spliced in by native_topk.source(): the same text builds with NVRTC (sm_80+) and as HIP (hipRTC or
// clang, gfx942 / gfx950: the row kernels; the cluster kernels are compiled out there).  Build selection: by default
// every kernel is built; with -DTOPK_SINGLE -DTOPK_KERNEL_<name> only <name> is (one program, one cache entry, per
// kernel).

#include "native_compat.h"

#define TOPK_ALL 0xFFFFFFFFu
// TOPK_BULK: on sm_90 the cached row (chunk) is streamed into shared memory with 1-D bulk
// copies (cp.async.bulk, TMA engine) in up to 16 pieces, each with its own mbarrier; pass 1
// converts/histograms piece p while later pieces are still in flight.  0 = plain vector loads.
#define TOPK_MAX_PIECES 16
// TOPK_TRACE (diagnostic builds only, benchmarks/topk_trace.py): thread 0 of each of the first TOPK_TRACE CTAs
// stores the SM clock at the numbered stage boundaries (and the global timer at entry and exit) into topk_trace.
#ifdef TOPK_TRACE
#define TOPK_TRACE_SLOTS 32
__device__ long long topk_trace[TOPK_TRACE * TOPK_TRACE_SLOTS];
__device__ __forceinline__ long long global_ns() {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#define TRACE_STORE(i, value)                                                                  \
    do {                                                                                       \
        if (threadIdx.x == 0 && blockIdx.x < TOPK_TRACE)                                       \
            topk_trace[blockIdx.x * TOPK_TRACE_SLOTS + (i)] = (value);                         \
    } while (0)
#define TRACE(i) TRACE_STORE(i, clock64())
#define TRACE_NS(i) TRACE_STORE(i, global_ns())
#else
#define TRACE(i) do {} while (0)
#define TRACE_NS(i) do {} while (0)
#endif
// The measured alternatives of this source (the builds each side of a compile-time switch) were timed on the H100
// and H200 and only the faster side is kept: docs/design-log/2026-12-06-native-topk-switches.md lists each change
// tried, which side ships and the measurements.
// shared-memory layout (32-bit words)
#define ROW_FIXED_WORDS 2216   // H[2048] | scan[128] | res[8] | mbarriers[16 x u64] | buf...
#define CL_FIXED_WORDS 7344    // H[2048] | S0[2048] | S1[2048] | S2[1024] | scan[128] | res[8] | base[8] | mbarriers[16 x u64] | cache...
#define CL_MBAR_WORD 7312      // the cluster kernels' mbarriers: words [CL_MBAR_WORD, CL_FIXED_WORDS)
// The clusters' gather: the gathered (key, column) pairs take S1 and S2, less their last 16 words (each source CTA's slot
// offset in every target).
#define CL_GATHER_WORD 4096
#define CL_GATHER_PAIRS 1520
#define CL_GATHER_OFFSETS_WORD 7152
#define ROW_MBAR_WORD 2184     // the row kernels' mbarriers: words [ROW_MBAR_WORD, ROW_FIXED_WORDS)

__device__ __forceinline__ unsigned f2key(float x) {
    const unsigned b = __float_as_uint(x + 0.0f);  // -0 + 0 = +0 (round to nearest); x otherwise (NaN never comes)
    return b ^ ((unsigned)((int)b >> 31) | 0x80000000u);
}

__device__ __forceinline__ unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }
__device__ __forceinline__ unsigned umax(unsigned a, unsigned b) { return a > b ? a : b; }
__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

// Which keys a radix pass looks at and which digit it histograms.
struct PassCfg {
    unsigned mask_hi, want_hi;  // key participates iff (key & mask_hi) == want_hi
    int shift;
    unsigned dmask;
};

// ---------------------------------------------------------------------------------------
// Block-wide exclusive scan of one unsigned per thread; `total` gets the block sum.
// `s` needs BLOCK/WS + 1 words.  Two consecutive calls must use different buffers
// (ping-pong) unless a __syncthreads() separates the second call from the first's reads.
template <int BLOCK>
__device__ __forceinline__ unsigned block_excl_scan(unsigned v, unsigned& total, unsigned* s) {
    constexpr int NW = BLOCK / WS;
    const int lane = threadIdx.x % WS, warp = threadIdx.x / WS;
    unsigned x = v;
#pragma unroll
    for (int o = 1; o < WS; o <<= 1) {
        unsigned y = shfl_up(x, o);
        if (lane >= o) x += y;
    }
    if (lane == WS - 1) s[warp] = x;
    __syncthreads();
    if (warp == 0) {
        unsigned w = (lane < NW) ? s[lane] : 0u;
        unsigned wi = w;
#pragma unroll
        for (int o = 1; o < NW; o <<= 1) {
            unsigned y = shfl_up(wi, o);
            if (lane >= o) wi += y;
        }
        if (lane < NW) s[lane] = wi - w;
        if (lane == NW - 1) s[NW] = wi;
    }
    __syncthreads();
    total = s[NW];
    return s[warp] + x - v;
}

// Threshold-bin search.  Thread t owns bins NB-1-(t*PER+i), i.e. bins are walked from the top.
// Given the per-bin counts `loc` of the owned bins and the rank `krem` (1-based) still to be
// found, writes res[0] = bin b with above(b) < krem <= above(b) + H[b], res[1] = krem - above(b),
// res[2] = H[b].  Ends with __syncthreads().
template <int BLOCK, int NB>
__device__ __forceinline__ void select_bin(const unsigned (&loc)[NB / BLOCK], unsigned krem,
                                           unsigned* s_scan, unsigned* s_res) {
    constexpr int PER = NB / BLOCK;
    unsigned sum = 0;
#pragma unroll
    for (int i = 0; i < PER; ++i) sum += loc[i];
    unsigned tot;
    unsigned above = block_excl_scan<BLOCK>(sum, tot, s_scan);
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        unsigned c = loc[i];
        if (above < krem && above + c >= krem) {
            s_res[0] = NB - 1 - (threadIdx.x * PER + i);
            s_res[1] = krem - above;
            s_res[2] = c;
        }
        above += c;
    }
    __syncthreads();
}

// The bins of H[0, NB) this thread owns in select_bin (NB-1-(t*PER+i)), which it also zeroes: select_bin's closing
// barrier orders that before any later pass adds into H, so H is zero again after every bin search (the next
// digit's histogram and the tie bitmap need no zeroing pass).
template <int BLOCK, int NB>
__device__ __forceinline__ void take_loc(unsigned* H, unsigned (&loc)[NB / BLOCK]) {
    constexpr int PER = NB / BLOCK;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int b = NB - 1 - (threadIdx.x * PER + i);
        loc[i] = H[b];
        H[b] = 0u;
    }
}

// The bin search over H[0, NB) for the rank krem (take_loc, then select_bin).
template <int BLOCK, int NB>
__device__ __forceinline__ void select_in(unsigned* H, unsigned krem, unsigned* s_scan, unsigned* s_res) {
    unsigned loc[NB / BLOCK];
    take_loc<BLOCK, NB>(H, loc);
    select_bin<BLOCK, NB>(loc, krem, s_scan, s_res);
}

// Histogram one quad of keys (nvalid of them valid): one shared atomic per participating key.
__device__ __forceinline__ void hist_quad(unsigned* H, const unsigned (&k)[4], int nvalid,
                                          const PassCfg& c) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
        if (i < nvalid && (k[i] & c.mask_hi) == c.want_hi) atomicAdd(&H[(k[i] >> c.shift) & c.dmask], 1u);
    return;
}

// Load one quad of a global row segment.  Columns >= nvalid are not read.
__device__ __forceinline__ void load_quad_g(const float* __restrict__ g, int col, int nvalid, bool vec,
                                            float (&v)[4]) {
    if (nvalid == 4 && vec) {
        float4 t = __ldg(reinterpret_cast<const float4*>(g + col));
        v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w;
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = (i < nvalid) ? __ldg(g + col + i) : 0.0f;
    }
}

__device__ __forceinline__ int quad_valid(int len, int q) {
    int r = len - 4 * q;
    return r < 0 ? 0 : (r > 4 ? 4 : r);
}

// Pass 1: the only read of the row from global memory.  U quads per thread are loaded
// before any is used (memory-level parallelism).  Keys optionally go to the smem cache.
template <int BLOCK, int U>
__device__ __forceinline__ void pass_first(const float* __restrict__ g, int len, bool vec,
                                           unsigned* cache, unsigned* H, bool count) {
    const PassCfg c = {0u, 0u, 21, 0x7FFu};
    const int nq = (len + 3) >> 2;
    for (int q0 = 0; q0 < nq; q0 += BLOCK * U) {
        float v[U][4];
        int nv[U];
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const int q = q0 + j * BLOCK + threadIdx.x;
            nv[j] = quad_valid(len, q);
            load_quad_g(g, 4 * q, nv[j], vec, v[j]);
        }
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const int q = q0 + j * BLOCK + threadIdx.x;
            unsigned k[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) k[i] = f2key(v[j][i]);
            if (cache != nullptr && nv[j] > 0)
                *reinterpret_cast<uint4*>(cache + 4 * q) = make_uint4(k[0], k[1], k[2], k[3]);
            if (count) hist_quad(H, k, nv[j], c);
        }
    }
}

#if TOPK_BULK
#if !TOPK_EMULATE
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait0(unsigned bar) {
    unsigned done = 0;
    while (!done) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar) : "memory");
    }
}
__device__ __forceinline__ void bulk_g2s(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// The initialised mbarriers visible to the bulk-copy engine before the first copy is issued.
__device__ __forceinline__ void mbar_fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
#endif  // !TOPK_EMULATE

// Pass 1 through the bulk-copy engine.  Requires g and cache 16-byte aligned.  The full quads
// arrive as floats in `cache` and are converted to keys in place (each quad has one owner).
// bulk_issue (thread 0) sets up one mbarrier per piece and starts the copies; a __syncthreads() must
// separate it from pass_first_bulk, and the zeroing of H from pass_first_bulk's histogram.
__device__ __forceinline__ int bulk_piece_quads(int len) {
    constexpr int min_piece_q = 2048;  // 32 KB: smaller pieces start pass 1 sooner, but more waits cost more
    const int piece_q = ((len >> 2) + TOPK_MAX_PIECES - 1) / TOPK_MAX_PIECES;
    return piece_q < min_piece_q ? min_piece_q : piece_q;
}
__device__ __forceinline__ void bulk_issue(const float* __restrict__ g, int len, unsigned* cache,
                                           unsigned long long* bars) {
    const int nfull = len >> 2, piece_q = bulk_piece_quads(len);
    const int npieces = (nfull + piece_q - 1) / piece_q;
    const unsigned bar0 = smem_u32(bars);
    if (threadIdx.x == 0) {
        for (int p = 0; p < npieces; ++p) mbar_init(bar0 + 8u * p, 1u);
        mbar_fence_init();
        const unsigned dst0 = smem_u32(cache);
        for (int p = 0; p < npieces; ++p) {
            const int q0 = p * piece_q;
            const int nq = imin(piece_q, nfull - q0);
            mbar_expect_tx(bar0 + 8u * p, 16u * nq);
            bulk_g2s(dst0 + 16u * q0, g + 4 * q0, 16u * nq, bar0 + 8u * p);
        }
    }
}
template <int BLOCK>
__device__ __forceinline__ void pass_first_bulk(const float* __restrict__ g, int len, unsigned* cache, unsigned* H,
                                                unsigned long long* bars, bool count) {
    const PassCfg c = {0u, 0u, 21, 0x7FFu};
    const int nfull = len >> 2, piece_q = bulk_piece_quads(len);
    const int npieces = (nfull + piece_q - 1) / piece_q;
    const unsigned bar0 = smem_u32(bars);
    for (int p = 0; p < npieces; ++p) {
        const int q0 = p * piece_q;
        const int q1 = imin(q0 + piece_q, nfull);
        mbar_wait0(bar0 + 8u * p);
        if (p == 0) TRACE(18);
        if (p == npieces - 1) TRACE(19);
        // No warp-wide step in the histogram: each thread walks its own quads, every key counted unconditionally.
        for (int q = q0 + threadIdx.x; q < q1; q += BLOCK) {
            const uint4 t = *reinterpret_cast<const uint4*>(cache + 4 * q);
            const unsigned k[4] = {f2key(__uint_as_float(t.x)), f2key(__uint_as_float(t.y)),
                                   f2key(__uint_as_float(t.z)), f2key(__uint_as_float(t.w))};
            *reinterpret_cast<uint4*>(cache + 4 * q) = make_uint4(k[0], k[1], k[2], k[3]);
            if (count) {
#pragma unroll
                for (int i = 0; i < 4; ++i) atomicAdd(&H[k[i] >> 21], 1u);
            }
        }
    }
    const int rem = len & 3;
    if (rem && threadIdx.x == 0) {  // last partial quad: plain loads
        for (int i = 0; i < 4; ++i) {
            const unsigned kk = i < rem ? f2key(__ldg(g + 4 * nfull + i)) : 0u;
            cache[4 * nfull + i] = kk;
            if (count && i < rem) atomicAdd(&H[kk >> 21], 1u);
        }
    }
}
#endif

// The keys of quad q (columns 4q .. 4q+3, nvalid of them valid): from the row's key cache s when there is one,
// else mapped from the logits g (f2key); the invalid ones are 0 (callers skip them by nvalid).
__device__ __forceinline__ void load_key_quad(const float* __restrict__ g, const unsigned* s, int q, int nvalid,
                                              bool vec, unsigned k[4]) {
    if (s != nullptr) {
        if (nvalid > 0) {
            const uint4 t = *reinterpret_cast<const uint4*>(s + 4 * q);
            k[0] = t.x; k[1] = t.y; k[2] = t.z; k[3] = t.w;
        } else {
            k[0] = k[1] = k[2] = k[3] = 0u;
        }
    } else {
        float v[4];
        load_quad_g(g, 4 * q, nvalid, vec, v);
#pragma unroll
        for (int i = 0; i < 4; ++i) k[i] = f2key(v[i]);
    }
}

// Passes 2/3: histogram the keys of the current prefix, reading either shared keys `s`
// (cache or candidate buffer, padded to a multiple of 4) or the global row `g`.
// If `cand` != nullptr, keys with the prefix are also appended (unordered; only counts
// derived from them are ever used) to cand, with *s_ncand as the fill counter.
template <int BLOCK, int U>
__device__ __forceinline__ void pass_count(const float* __restrict__ g, const unsigned* s, int len, bool vec,
                                           unsigned* H, const PassCfg& c, unsigned* cand, unsigned* s_ncand) {
    const int nq = (len + 3) >> 2;
    const int lane = threadIdx.x % WS;
    for (int q0 = 0; q0 < nq; q0 += BLOCK * U) {
        unsigned k[U][4];
        int nv[U];
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const int q = q0 + j * BLOCK + threadIdx.x;
            nv[j] = quad_valid(len, q);
            load_key_quad(g, s, q, nv[j], vec, k[j]);
        }
#pragma unroll
        for (int j = 0; j < U; ++j) {
            hist_quad(H, k[j], nv[j], c);
            if (cand != nullptr) {
                unsigned mc = 0;
#pragma unroll
                for (int i = 0; i < 4; ++i) mc += (i < nv[j] && (k[j][i] & c.mask_hi) == c.want_hi) ? 1u : 0u;
                if (warp_any(mc != 0)) {
                    unsigned x = mc;
#pragma unroll
                    for (int o = 1; o < WS; o <<= 1) {
                        unsigned y = shfl_up(x, o);
                        if (lane >= o) x += y;
                    }
                    unsigned base = 0;
                    if (lane == WS - 1) base = atomicAdd(s_ncand, x);
                    base = shfl_idx(base, WS - 1);
                    unsigned pos = base + x - mc;
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        if (i < nv[j] && (k[j][i] & c.mask_hi) == c.want_hi) cand[pos++] = k[j][i];
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The fused expansion (what qsa_expand_block_indices computes), run by the CTA that owns a row once
// the row's groups are written: each selected group g >= 0 gives the tokens g*R .. g*R+R-1 below
// the request's context length (a prefix of the group), packed by an exclusive scan over the
// groups; then the causal tail ((p+1)/R)*R .. p (capped by the context length); then -1.  A row
// whose request is outside [0, num_requests) is all -1.  Indices are int32: tokens at or past
// 2**31 are cut like tokens past the context.  positions / contexts / requests are int32 or
// int64 (bits 0 / 1 / 2 of idx_wide).
#define TOPK_TOKEN_LIMIT 2147483648LL

__device__ __forceinline__ long long load_index(const void* p, long long i, bool wide) {
    return wide ? reinterpret_cast<const long long*>(p)[i] : (long long)reinterpret_cast<const int*>(p)[i];
}

// A group written by this row's CTAs (read past L1: in a cluster other CTAs wrote it).
__device__ __forceinline__ int load_group(const int* p) { return load_cg(p); }

// A request's context length as read (negative, or past what int32 token indices hold) as the expansion uses it.
__device__ __forceinline__ long long context_limit(long long read) {
    return read < 0 ? 0 : (read > TOPK_TOKEN_LIMIT ? TOPK_TOKEN_LIMIT : read);
}

__device__ __forceinline__ unsigned tokens_kept(long long g, long long limit, int R) {
    if (g < 0 || g * R >= limit) return 0u;  // a group past the context (or a negative id) keeps no token
    const long long c = limit - g * R;
    return (unsigned)(c < R ? c : R);
}

// Where the output passes put each kept group's tokens.  FUSED (the cluster kernels): the tokens written where the
// groups are: the group at output slot s keeps its tokens at s*R onwards, since every kept group before it is a lower
// group and keeps all R (only the group that holds the context's end keeps fewer, and no later group keeps any); no
// re-read of the groups, and in a cluster no barrier before the expansion.  COPIES (the row kernels): each group
// copied into shared memory at its slot (groups, K words; nullptr: not this launch), from which the expansion after
// the top-k reads them (expand_copied: no second read of the groups from global memory, no scan to place them).
//
// The row's facts are read in two steps so that no thread waits for them before the top-k: its request and position
// where the sink is made (at the kernel's start), the request's context length once the row's visible count has
// arrived (fetch_context: the request id came with it; after a barrier, where no thread waits for it), and the
// length is first used (limit()) by the output.
template <bool FUSED, bool COPIES = false>
struct TokenSink {
    static constexpr bool fused = FUSED, copies = COPIES;
    int* trow;        // the row's token indices; nullptr: no fused expansion
    long long p;      // the row's position
    int R;
    unsigned count;   // tokens this thread wrote
    unsigned* groups = nullptr;
    long long req = -1;  // the row's request, until fetch_context
    const void* ctx = nullptr;
    int num_requests = 0;
    bool wide_ctx = false;
    // The request's context length as read (0 for a bad request): its low word (an int32 length's only one) and an
    // int64 length's high word, each loaded into its own register and joined only where used (an extension or a
    // move right after the load would wait for it).
    unsigned ctx_lo = 0u, ctx_hi = 0u;

    __device__ __forceinline__ void fetch_context() {
        if (trow != nullptr && req >= 0 && req < num_requests) {
            const unsigned* w = reinterpret_cast<const unsigned*>(ctx) + (wide_ctx ? 2 * req : req);
            ctx_lo = w[0];
            if (wide_ctx) ctx_hi = w[1];
        }
    }
    // The context length the expansion keeps tokens below (0 for a bad request, at most TOPK_TOKEN_LIMIT).
    __device__ __forceinline__ long long limit() const {
        return context_limit(wide_ctx ? (long long)(((unsigned long long)ctx_hi << 32) | ctx_lo)
                                      : (long long)(int)ctx_lo);
    }
};
// The row's request and position where tok != nullptr (fetch_context reads the context length).
template <bool FUSED = true, bool COPIES = false>
__device__ __forceinline__ TokenSink<FUSED, COPIES> token_facts(int row, const void* pos, const void* ctx,
                                                                const void* t2r, int* tok, int num_requests, int R,
                                                                int tok_ld, int idx_wide) {
    TokenSink<FUSED, COPIES> t = {nullptr, 0, R, 0u};
    if (tok != nullptr) {
        t.req = load_index(t2r, row, idx_wide & 4);
        t.p = load_index(pos, row, idx_wide & 1);
        t.trow = tok + (long long)row * tok_ld;
        t.ctx = ctx;
        t.num_requests = num_requests;
        t.wide_ctx = (idx_wide & 2) != 0;
    }
    return t;
}
// The sink the output passes write into: the row's tokens where FUSED; the groups into `groups` where COPIES.  The
// caller calls fetch_context once the row's visible count is read.
template <bool FUSED, bool COPIES = false>
__device__ __forceinline__ TokenSink<FUSED, COPIES> token_sink(int row, const void* pos, const void* ctx,
                                                               const void* t2r, int* tok, int num_requests, int R,
                                                               int tok_ld, int idx_wide, unsigned* groups = nullptr) {
    auto t = token_facts<FUSED, COPIES>(row, pos, ctx, t2r, tok, num_requests, R, tok_ld, idx_wide);
    if (COPIES && tok != nullptr) t.groups = groups;
    return t;
}
// The tokens of group g at output slot `slot`; how many.  A whole group of 4 in a row of 16-byte aligned token
// slots is one 16-byte store.  Not inlined: the output passes call it from many unrolled sites,
// and only for the few kept groups (inlined, it doubles the kernels' code).
__device__ __noinline__ unsigned write_group_tokens(int* __restrict__ trow, long long limit, int R, long long slot,
                                                    long long g) {
    const unsigned c = tokens_kept(g, limit, R);
    const int t0 = (int)(g * R);
    if (R == 4 && c == 4u && (reinterpret_cast<unsigned long long>(trow) & 15u) == 0)
        *reinterpret_cast<int4*>(trow + slot * 4) = make_int4(t0, t0 + 1, t0 + 2, t0 + 3);
    else
        for (unsigned j = 0; j < c; ++j) trow[slot * R + j] = t0 + (int)j;
    return c;
}
// Group g was written to output slot `slot`: the sink's share of it.
template <class Sink>
__device__ __forceinline__ void put_tokens(Sink& t, long long slot, long long g) {
    if constexpr (Sink::fused)
        if (t.trow != nullptr) t.count += write_group_tokens(t.trow, t.limit(), t.R, slot, g);
    if constexpr (Sink::copies)
        if (t.groups != nullptr) t.groups[slot] = (unsigned)g;
}
// After the row's `total` group tokens: the causal tail ((p+1)/R)*R .. p below the context's end, then -1 up to
// `width`; columns first, first + stride, ... of it.
__device__ __forceinline__ void write_tail(int* __restrict__ trow, long long p, long long limit, int R, long long total,
                                           int width, int first, int stride) {
    const long long tail_start = p >= 0 ? (p + 1) / R * R : 0;
    long long tail_len = (p + 1 < limit ? p + 1 : limit) - tail_start;
    tail_len = tail_len < 0 ? 0 : tail_len;
    for (long long w = total + first; w < width; w += stride) {
        const long long rel = w - total;
        trow[w] = rel < tail_len ? (int)(tail_start + rel) : -1;
    }
}

// Ordered output pass over columns [0, len) of a segment whose first column is `col0`.
// Each thread owns EU consecutive quads of a tile of BLOCK*EU quads; a block scan of packed
// (eq << 16 | gt) counts (<= 4*EU*BLOCK per tile < 65536) gives every element its number of
// preceding key>T and key==T elements.  base_gt/base_eq: counts before this segment.
template <int BLOCK, int EU, class Sink>
__device__ __forceinline__ void pass_emit(const float* __restrict__ g, const unsigned* s, int len, bool vec,
                                          int col0, unsigned T, unsigned e, unsigned base_gt,
                                          unsigned base_eq, int* __restrict__ orow, unsigned K,
                                          unsigned* s_scan, Sink& ts) {
    constexpr int NW = BLOCK / WS;
    const int nq = (len + 3) >> 2;
    int parity = 0;
    for (int q0 = 0; q0 < nq; q0 += BLOCK * EU) {
        if (base_gt + umin(base_eq, e) >= K) break;  // block-uniform
        unsigned k[EU][4];
        int nv[EU];
        unsigned cgt = 0, ceq = 0;
#pragma unroll
        for (int j = 0; j < EU; ++j) {
            const int q = q0 + threadIdx.x * EU + j;
            nv[j] = quad_valid(len, q);
            load_key_quad(g, s, q, nv[j], vec, k[j]);
        }
#pragma unroll
        for (int j = 0; j < EU; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if (i < nv[j]) {
                    cgt += k[j][i] > T ? 1u : 0u;
                    ceq += k[j][i] == T ? 1u : 0u;
                }
            }
        unsigned tot;
        const unsigned ex = block_excl_scan<BLOCK>((ceq << 16) | cgt, tot, s_scan + parity * (NW + 1));
        parity ^= 1;
        unsigned gt = base_gt + (ex & 0xFFFFu);
        unsigned eq = base_eq + (ex >> 16);
        if (cgt | ceq) {
#pragma unroll
            for (int j = 0; j < EU; ++j) {
                const int q = q0 + threadIdx.x * EU + j;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    if (i < nv[j]) {
                        const unsigned kk = k[j][i];
                        if (kk > T) {
                            orow[gt + umin(eq, e)] = col0 + 4 * q + i;
                            put_tokens(ts, gt + umin(eq, e), col0 + 4 * q + i);
                            ++gt;
                        } else if (kk == T) {
                            if (eq < e) {
                                orow[gt + eq] = col0 + 4 * q + i;
                                put_tokens(ts, gt + eq, col0 + 4 * q + i);
                            }
                            ++eq;
                        }
                    }
                }
            }
        }
        base_gt += tot & 0xFFFFu;
        base_eq += tot >> 16;
    }
}

// Rows with n <= K: 0..n-1 then -1 (scores never read).  The sink gets every slot, the -1 ones too (they keep no
// token; a copying sink's expansion reads all K).
template <class Sink>
__device__ __forceinline__ void write_short(int* __restrict__ orow, int n, int K, int first, int stride, Sink& ts) {
    for (int i = first; i < K; i += stride) {
        const int g = i < n ? i : -1;
        orow[i] = g;
        put_tokens(ts, i, g);
    }
}

// ---------------------------------------------------------------------------------------
// Fast path (cached keys, threshold bin of pass 1 small enough for the candidate list).
// Pass 2 reads every key once: keys whose top digit is above the threshold bin b0 (or in it,
// when the whole bin is taken) are certainly selected and are marked in the column bitmap SB;
// the columns (16-bit, segment-relative) of keys in b0 go to the candidate list.  Passes 3/4
// histogram the candidates only.  Selected candidates are marked in SB, exact ties (key == T)
// in TB; the first e ties in column order are moved to SB by a prefix popcount over TB, and a
// prefix popcount over SB gives every selected column its output slot, in column order.
// The 4-bit masks of a quad's keys (t; valid: its columns inside the row) whose top digit is >= thr (kept) and
// == want (listed).
__device__ __forceinline__ void quad_masks(const uint4 t, unsigned valid, unsigned thr, unsigned want, unsigned& kept,
                                           unsigned& listed) {
    const unsigned d[4] = {t.x >> 21, t.y >> 21, t.z >> 21, t.w >> 21};
    kept = 0;
    listed = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        kept |= (d[i] >= thr ? 1u : 0u) << i;
        listed |= (d[i] == want ? 1u : 0u) << i;
    }
    kept &= valid;
    listed &= valid;
}

// One quad q of the classify pass (keys t; valid: its columns inside the row, as a 4-bit mask).  A quad's four
// columns are bits 4 (q & 7) .. 4 (q & 7) + 3 of bitmap word q >> 3: one OR per quad, and one counter update per
// quad holding candidates.
__device__ __forceinline__ void classify_quad(const uint4 t, int q, unsigned valid, unsigned thr,
                                              unsigned want, unsigned* SB, unsigned short* cand, unsigned* s_ncand,
                                              unsigned& marked) {
    unsigned kept, listed;
    quad_masks(t, valid, thr, want, kept, listed);
    if (kept) atomicOr(&SB[q >> 3], kept << (4 * (q & 7)));
    marked += __popc(kept);
    if (listed) {
        unsigned slot = atomicAdd(s_ncand, (unsigned)__popc(listed));
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if ((listed >> i) & 1u) cand[slot++] = (unsigned short)(4 * q + i);
    }
}

// The classify pass: UNITS (the row kernels) a unit of 16 columns per thread at a time; else (the clusters, whose
// chunks split into fewer, unevenly shared units) a quad at a time.
template <int BLOCK, bool UNITS>
__device__ __forceinline__ unsigned pass_classify(const unsigned* cache, int len, unsigned b0, bool exhausted,
                                                  unsigned* SB, unsigned short* cand, unsigned* s_ncand) {
    unsigned marked = 0;  // the columns this thread marked (callers that need the count use it)
    const unsigned thr = exhausted ? b0 : b0 + 1u;     // mark top digit >= thr
    const unsigned want = exhausted ? 0xFFFFFFFFu : b0;  // list top digit == want (no digit is 0xFFFFFFFF)
    if constexpr (UNITS) {
        // A thread a unit of 16 columns (4 quads) at a time: the unit's half of a bitmap word is the thread's own
        // (one plain 16-bit store, no atomic), and its candidates take one counter update.  Lanes read the quads of
        // their 64-byte units in a rotated order (lane / 2), so that the 8 lanes of a 16-byte access phase hit 8
        // distinct bank groups.
        unsigned short* SBh = reinterpret_cast<unsigned short*>(SB);
        const int nunits = (len + 15) >> 4, rot = (threadIdx.x % WS) >> 1;
        for (int u = threadIdx.x; u < nunits; u += BLOCK) {
            unsigned kept = 0, listed = 0;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int jj = (j + rot) & 3, q = 4 * u + jj;
                const int nv = quad_valid(len, q);
                if (nv > 0) {
                    unsigned k4, l4;
                    quad_masks(*reinterpret_cast<const uint4*>(cache + 4 * q), (1u << nv) - 1u, thr, want, k4, l4);
                    kept |= k4 << (4 * jj);
                    listed |= l4 << (4 * jj);
                }
            }
            if (kept) SBh[u] = (unsigned short)kept;
            marked += __popc(kept);
            if (listed) {
                unsigned slot = atomicAdd(s_ncand, (unsigned)__popc(listed));
                do {
                    cand[slot++] = (unsigned short)(16 * u + __ffs(listed) - 1);
                    listed &= listed - 1u;
                } while (listed);
            }
        }
        return marked;
    }
    const int nq = (len + 3) >> 2;
#pragma unroll 2
    for (int q = threadIdx.x; q < nq; q += BLOCK)
        classify_quad(*reinterpret_cast<const uint4*>(cache + 4 * q), q, (1u << quad_valid(len, q)) - 1u, thr,
                      want, SB, cand, s_ncand, marked);
    return marked;
}

template <int BLOCK>
__device__ __forceinline__ void cand_hist(const unsigned* cache, const unsigned short* cand, int ncand,
                                          unsigned* H, const PassCfg& c) {
    for (int i = threadIdx.x; i < ncand; i += BLOCK) {
        const unsigned k = cache[cand[i]];
        if ((k & c.mask_hi) == c.want_hi) atomicAdd(&H[(k >> c.shift) & c.dmask], 1u);
    }
}

template <int BLOCK>
__device__ __forceinline__ void cand_mark(const unsigned* cache, const unsigned short* cand, int ncand,
                                          unsigned T, unsigned e, unsigned* SB, unsigned* TB) {
    for (int i = threadIdx.x; i < ncand; i += BLOCK) {
        const unsigned col = cand[i];
        const unsigned k = cache[col];
        if (k > T || (k == T && e == TOPK_ALL))
            atomicOr(&SB[col >> 5], 1u << (col & 31));
        else if (k == T)
            atomicOr(&TB[col >> 5], 1u << (col & 31));
    }
}

// Sum of popcounts of this thread's consecutive words [w0, w1).
__device__ __forceinline__ unsigned popc_words(const unsigned* B, int w0, int w1) {
    unsigned c = 0;
    for (int w = w0; w < w1; ++w) c += __popc(B[w]);
    return c;
}

// Writes the columns of SB (after moving the first e - base_eq ties of TB into it) to
// orow[base_gt + min(base_eq, e) + rank], in column order.  Thread t owns words [t*W, t*W+W).
template <int BLOCK, class Sink>
__device__ __forceinline__ void bitmap_emit(unsigned* SB, const unsigned* TB, int nw, unsigned e, unsigned base_gt,
                                            unsigned base_eq, bool ties, int col0, int* __restrict__ orow,
                                            unsigned* s_scan, Sink& ts) {
    const int W = (nw + BLOCK - 1) / BLOCK;
    const int w0 = imin(nw, threadIdx.x * W), w1 = imin(nw, w0 + W);
    unsigned tot;
    if (ties) {  // block-uniform
        unsigned r = base_eq + block_excl_scan<BLOCK>(popc_words(TB, w0, w1), tot, s_scan);
        for (int w = w0; w < w1 && r < e; ++w) {
            unsigned b = TB[w], add = 0;
            while (b && r < e) {
                const unsigned lsb = b & (0u - b);
                add |= lsb;
                b ^= lsb;
                ++r;
            }
            SB[w] |= add;  // this thread owns word w
        }
    }
    unsigned pos = base_gt + umin(base_eq, e) + block_excl_scan<BLOCK>(popc_words(SB, w0, w1), tot, s_scan + 64);
    for (int w = w0; w < w1; ++w) {
        unsigned b = SB[w];
        while (b) {
            const int bit = __ffs(b) - 1;
            put_tokens(ts, pos, col0 + 32 * w + bit);
            orow[pos++] = col0 + 32 * w + bit;
            b &= b - 1u;
        }
    }
}

// ---------------------------------------------------------------------------------------
// One CTA per row.
template <int BLOCK, int U, class Sink>
__device__ __forceinline__ void row_topk(const float* __restrict__ logits, const int* __restrict__ visible,
                                         int* __restrict__ out, int rows, int columns, int ld, int K,
                                         int buf_cap, int cached, int vec_ok, int cand_cap,
                                         const unsigned* __restrict__ hist, Sink& ts) {
    TOPK_DYNAMIC_SMEM(smem_row);
    unsigned* H = smem_row;              // 2048
    unsigned* s_scan = smem_row + 2048;  // 2 x 64
    unsigned* s_res = smem_row + 2176;   // 8: [0..2] select_bin result, [7] candidate count
    // fast-path areas (cached mode): SB bitmap (nwcap words), candidate columns (cand_cap x u16)
    const int nwcap = cached ? ((((buf_cap + 31) >> 5) + 3) & ~3) : 0;
    unsigned* SB = smem_row + ROW_FIXED_WORDS;
    unsigned short* cand = reinterpret_cast<unsigned short*>(SB + nwcap);
    unsigned* buf = SB + nwcap + (cand_cap >> 1);
    TRACE_NS(30);
    TRACE(0);
    const int row = blockIdx.x;
    if (row >= rows) return;
    int n = visible[row];
    n = n < 0 ? 0 : (n > columns ? columns : n);
    TRACE(1);
    int* orow = out + (long long)row * K;
    if (n <= K) {
        ts.fetch_context();
        write_short(orow, n, K, threadIdx.x, BLOCK, ts);
        return;
    }
    const float* g = logits + (long long)row * ld;
    const bool vec = vec_ok != 0;
    const unsigned* src = cached ? buf : nullptr;  // source of keys for later passes

    // With the scorer's histogram (hist != nullptr) pass 1 only caches the keys: its histogram is the scorer's.
    const unsigned* hrow = hist != nullptr ? hist + (long long)row * 2048 : nullptr;
#if TOPK_BULK
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(smem_row + ROW_MBAR_WORD);
#endif
    for (int i = threadIdx.x; i < 2048; i += BLOCK) H[i] = hrow != nullptr ? hrow[i] : 0u;
    for (int i = threadIdx.x; i < nwcap; i += BLOCK) SB[i] = 0u;
    if (threadIdx.x == 0) s_res[7] = 0u;
    __syncthreads();
    ts.fetch_context();  // after the barrier: no thread waits for the request id before the row's first loads
    TRACE(2);
#if TOPK_BULK
    if (cached && vec) {
        bulk_issue(g, n, buf, bars);
        __syncthreads();
        pass_first_bulk<BLOCK>(g, n, buf, H, bars, hrow == nullptr);
    } else
#endif
    if (cached || hrow == nullptr)  // uncached with the scorer's histogram: nothing for pass 1 to do
        pass_first<BLOCK, U>(g, n, vec, cached ? buf : nullptr, H, hrow == nullptr);
    __syncthreads();
    TRACE(3);

    unsigned T, e;
    select_in<BLOCK, 2048>(H, (unsigned)K, s_scan, s_res);
    const unsigned b0 = s_res[0], krem1 = s_res[1], cnt1 = s_res[2];
    TRACE(6);
    if (cached && (cnt1 == krem1 || cnt1 <= (unsigned)cand_cap)) {
        const bool exhausted1 = cnt1 == krem1;
        pass_classify<BLOCK, true>(buf, n, b0, exhausted1, SB, cand, s_res + 7);
        __syncthreads();
        TRACE(7);
        const int nw = (n + 31) >> 5;
        unsigned T = 0, e = TOPK_ALL;
        if (!exhausted1) {
            const int ncand = (int)s_res[7];
            const PassCfg c1 = {0xFFE00000u, b0 << 21, 10, 0x7FFu};
            cand_hist<BLOCK>(buf, cand, ncand, H, c1);
            __syncthreads();
            TRACE(8);
            select_in<BLOCK, 2048>(H, krem1, s_scan, s_res);
            const unsigned b1 = s_res[0], krem2 = s_res[1], cnt2 = s_res[2];
            TRACE(10);
            const unsigned prefix = (b0 << 21) | (b1 << 10);
            if (cnt2 == krem2) {
                T = prefix;
            } else {
                const PassCfg c2 = {0xFFFFFC00u, prefix, 0, 0x3FFu};
                cand_hist<BLOCK>(buf, cand, ncand, H, c2);
                __syncthreads();
                select_in<BLOCK, 1024>(H, krem2, s_scan, s_res);
                T = prefix | s_res[0];
                e = s_res[1];
            }
            // H, zero again, becomes the tie bitmap TB
            TRACE(11);
            cand_mark<BLOCK>(buf, cand, ncand, T, e, SB, H);
            __syncthreads();
            TRACE(12);
        }
        bitmap_emit<BLOCK>(SB, H, nw, e, 0u, 0u, e != TOPK_ALL, 0, orow, s_scan, ts);
        TRACE(15);
        return;
    }
    if (cnt1 == krem1) {
        T = b0 << 21;
        e = TOPK_ALL;
    } else {
        for (int i = threadIdx.x; i < 2048; i += BLOCK) H[i] = 0u;
        __syncthreads();
        const PassCfg c1 = {0xFFE00000u, b0 << 21, 10, 0x7FFu};
        const bool compact = !cached && cnt1 <= (unsigned)buf_cap;
        pass_count<BLOCK, U>(g, src, n, vec, H, c1, compact ? buf : nullptr, s_res + 7);
        __syncthreads();
        select_in<BLOCK, 2048>(H, krem1, s_scan, s_res);
        const unsigned b1 = s_res[0], krem2 = s_res[1], cnt2 = s_res[2];
        const unsigned prefix = (b0 << 21) | (b1 << 10);
        if (cnt2 == krem2) {
            T = prefix;
            e = TOPK_ALL;
        } else {
            const unsigned ncand = s_res[7];
            for (int i = threadIdx.x; i < 1024; i += BLOCK) H[i] = 0u;
            __syncthreads();
            const PassCfg c2 = {0xFFFFFC00u, prefix, 0, 0x3FFu};
            if (compact)
                pass_count<BLOCK, U>(g, buf, (int)ncand, vec, H, c2, nullptr, nullptr);
            else
                pass_count<BLOCK, U>(g, src, n, vec, H, c2, nullptr, nullptr);
            __syncthreads();
            select_in<BLOCK, 1024>(H, krem2, s_scan, s_res);
            T = prefix | s_res[0];
            e = s_res[1];
        }
    }
    pass_emit<BLOCK, 4>(g, src, n, vec, 0, T, e, 0u, 0u, orow, (unsigned)K, s_scan, ts);
}

template <int BLOCK>
__device__ __forceinline__ void expand_row(const int* grow, int K, int row, const void* pos, const void* ctx,
                                           const void* t2r, int* __restrict__ tok, int num_requests, int R,
                                           int width, int tok_ld, int idx_wide, unsigned* s_scan) {
    auto facts = token_facts(row, pos, ctx, t2r, tok, num_requests, R, tok_ld, idx_wide);
    facts.fetch_context();
    const long long limit = facts.limit(), p = facts.p;
    const int per = (K + BLOCK - 1) / BLOCK;
    const int i0 = imin(K, threadIdx.x * per), i1 = imin(K, i0 + per);
    unsigned mine = 0;
    for (int i = i0; i < i1; ++i) mine += tokens_kept(load_group(grow + i), limit, R);
    unsigned total;
    unsigned slot = block_excl_scan<BLOCK>(mine, total, s_scan);
    int* trow = facts.trow;
    for (int i = i0; i < i1; ++i) {
        const long long g = load_group(grow + i);
        const unsigned c = tokens_kept(g, limit, R);
        for (unsigned j = 0; j < c; ++j) trow[slot + j] = (int)(g * R + j);
        slot += c;
    }
    write_tail(trow, p, limit, R, total, width, threadIdx.x, BLOCK);
}

// Token slot w of a row of R-token groups copied into shared memory: its token, or -1 where its group (-1 past the
// row's kept groups) keeps none.
__device__ __forceinline__ int token_at(const unsigned* groups, long long limit, int R, int w) {
    const unsigned slot = (unsigned)w / (unsigned)R;  // w >= 0: with R a constant 4, a shift
    const long long token = (long long)(int)groups[slot] * R + (w - (int)slot * R);
    return token >= 0 && token < limit ? (int)token : -1;
}

// The row's expansion from the groups its sink copied into shared memory (a barrier after the copies): slot s's
// tokens start at s*R, as with the fused tokens, so no scan places them; a scan counts them for the tail.  With
// R = 4 (no division by R per token) the first K*R slots go in 16-byte aligned blocks of 4 (a warp's
// consecutive; the words before the first 16-byte boundary and after the last one alone), a slot past the kept
// tokens with -1 and then the tail's value (after the scan's barriers); else each thread writes every BLOCK-th kept
// token.
template <int BLOCK, class Sink>
__device__ __forceinline__ void expand_copied(const Sink& t, int K, int width, unsigned* s_scan) {
    const int R = t.R, n = K * R;  // K <= 2048 where groups are copied
    const long long limit = t.limit();
    unsigned mine = 0;
    if (R == 4) {
        const int head = (int)((0u - (unsigned)(reinterpret_cast<unsigned long long>(t.trow) >> 2)) & 3u);
        const int blocks = (n - head) >> 2, rest = n - head - 4 * blocks;
        for (int b = threadIdx.x; b < blocks; b += BLOCK) {
            const int w = head + 4 * b;
            const int4 v = make_int4(token_at(t.groups, limit, 4, w), token_at(t.groups, limit, 4, w + 1),
                                     token_at(t.groups, limit, 4, w + 2), token_at(t.groups, limit, 4, w + 3));
            *reinterpret_cast<int4*>(t.trow + w) = v;
            mine += (v.x >= 0 ? 1u : 0u) + (v.y >= 0 ? 1u : 0u) + (v.z >= 0 ? 1u : 0u) + (v.w >= 0 ? 1u : 0u);
        }
        if (threadIdx.x < head || (threadIdx.x >= 4 && threadIdx.x < 4 + rest)) {
            const int w = threadIdx.x < head ? threadIdx.x : head + 4 * blocks + threadIdx.x - 4;
            const int v = token_at(t.groups, limit, 4, w);
            t.trow[w] = v;
            mine += v >= 0 ? 1u : 0u;
        }
    } else {
        for (int w = threadIdx.x; w < n; w += BLOCK) {
            const int v = token_at(t.groups, limit, R, w);
            if (v >= 0) {
                t.trow[w] = v;
                ++mine;
            }
        }
    }
    unsigned total;
    block_excl_scan<BLOCK>(mine, total, s_scan);
    write_tail(t.trow, t.p, limit, R, total, width, threadIdx.x, BLOCK);
}

// Kernel parameters: the pointers, then the scalars (the launcher passes them in this order).  tok == nullptr: no
// expansion (positions, contexts, requests and the last five scalars are unread).
#define TOPK_ROW_PARAMS                                                                          \
    const float *__restrict__ logits, const int *__restrict__ visible, int *__restrict__ out,   \
        const void *__restrict__ positions, const void *__restrict__ contexts,                  \
        const void *__restrict__ requests, int *__restrict__ tokens, const unsigned *__restrict__ histogram, \
        int rows, int columns, int ld, int K, int buf_cap, int cached, int vec_ok, int cand_cap, int num_requests, \
        int ratio, int width, int tok_ld, int idx_wide
#define TOPK_ROW_ARGS logits, visible, out, rows, columns, ld, K, buf_cap, cached, vec_ok, cand_cap, histogram, ts
#define TOPK_EXPAND_ARGS positions, contexts, requests, tokens, num_requests, ratio, width, tok_ld, idx_wide

// One CTA per row: the top-k, then (with tokens) the row's expansion by the same CTA.
template <int BLOCK>
__device__ __forceinline__ void row_kernel(TOPK_ROW_PARAMS) {
    TOPK_DYNAMIC_SMEM(smem_row);
    wait_for_prior_grid();
    const int row = blockIdx.x;
    // The groups' copies for the expansion go into H (free once the output pass runs), if K fits it.
    auto ts = token_sink<false, true>(row, positions, contexts, requests, row < rows ? tokens : nullptr,
                                      num_requests, ratio, tok_ld, idx_wide, K <= 2048 ? smem_row : nullptr);
    row_topk<BLOCK, 4>(TOPK_ROW_ARGS);
    if (tokens != nullptr && row < rows) {  // block-uniform: every path of row_topk returns here
        __syncthreads();  // the row's groups are written (and copied)
        TRACE(16);
        if (ts.groups != nullptr)
            expand_copied<BLOCK>(ts, K, width, smem_row + 2048);
        else
            expand_row<BLOCK>(out + (long long)row * K, K, row, TOPK_EXPAND_ARGS, smem_row + 2048);
        TRACE(17);
    }
    TRACE(29);
    TRACE_NS(31);
}
#define TOPK_ROW_CALL(BLOCK)                                                                                  \
    row_kernel<BLOCK>(logits, visible, out, positions, contexts, requests, tokens, histogram, rows, columns, ld, K, \
                      buf_cap, cached, vec_ok, cand_cap, num_requests, ratio, width, tok_ld, idx_wide)

#if !defined(TOPK_SINGLE) || defined(TOPK_KERNEL_topk_rows_256)
extern "C" __global__ void TOPK_LAUNCH_BOUNDS(256, 4) topk_rows_256(TOPK_ROW_PARAMS) {
    TOPK_ROW_CALL(256);
}
#endif
#if !defined(TOPK_SINGLE) || defined(TOPK_KERNEL_topk_rows_512)
extern "C" __global__ void TOPK_LAUNCH_BOUNDS(512, 2) topk_rows_512(TOPK_ROW_PARAMS) {
    TOPK_ROW_CALL(512);
}
#endif

// ---------------------------------------------------------------------------------------
// One thread-block cluster of CL CTAs per row (sm_90+).
#if defined(TOPK_SINGLE) && !TOPK_CLUSTERS &&                                                        \
    (defined(TOPK_KERNEL_topk_cluster2_512) || defined(TOPK_KERNEL_topk_cluster4_512) ||              \
     defined(TOPK_KERNEL_topk_cluster8_512) || defined(TOPK_KERNEL_topk_cluster16_512))
#error "the cluster kernels are compiled out on this target: thread-block clusters exist on CUDA from sm_90 only"
#endif
#if TOPK_CLUSTERS

// Push the non-zero bins of the local histogram H[0, NB) into S[0, NB) of every CTA of the
// cluster (including this one).  Sums are order-independent, so this stays deterministic.
template <int BLOCK, int NB, int CL>
__device__ __forceinline__ void push_hist(unsigned* H, unsigned* S) {
    const unsigned base = smem_u32(S);
    for (int b = threadIdx.x; b < NB; b += BLOCK) {
        const unsigned v = H[b];
        H[b] = 0u;  // the cluster barrier after the push orders this before the next pass adds into H
        if (v) {
#pragma unroll
            for (int r = 0; r < CL; ++r) red_add_cluster(mapa_u32(base + 4u * b, (unsigned)r), v);
        }
    }
}

template <int BLOCK, int NB>
__device__ __forceinline__ void load_loc(const unsigned* S, unsigned (&loc)[NB / BLOCK]) {
    constexpr int PER = NB / BLOCK;
#pragma unroll
    for (int i = 0; i < PER; ++i) loc[i] = S[NB - 1 - (threadIdx.x * PER + i)];
}

// The rest of a cluster's row after the first digit (threshold bin b0, rank krem1 in it, cnt1 keys in it over the
// whole row), by gathering: classify the chunk (surely kept columns into SB, the bin's columns into cand); send the
// count of surely kept columns to every higher rank's s_base[0] and the bin's (key, column) pairs into every CTA's
// gather buffer G (slots reserved with one returning remote add per target); one cluster barrier; then each CTA
// selects among the cnt1 gathered keys alone (digits 2 and 3 over G), marks its own chunk's selected candidates,
// counts the lower ranks' from G, and writes its slots.  Every pair is read by every CTA, none by arrival order.
template <int BLOCK, int CL, class Sink>
__device__ __forceinline__ long long gather_finish(const unsigned* cache, int len, int start, unsigned b0,
                                                   unsigned krem1, unsigned cnt1, unsigned* SB, unsigned short* cand,
                                                   int* orow, Sink& ts) {
    TOPK_DYNAMIC_SMEM(smem_cl);
    unsigned* H = smem_cl;
    unsigned* G = smem_cl + CL_GATHER_WORD;
    unsigned* s_goff = smem_cl + CL_GATHER_OFFSETS_WORD;
    unsigned* s_scan = smem_cl + 7168;
    unsigned* s_res = smem_cl + 7296;
    unsigned* s_base = smem_cl + 7304;  // [0] surely kept columns before this chunk, [2] pairs gathered here
    const unsigned rank = cluster_rank();
    const int lane = threadIdx.x % WS;
    unsigned marked = pass_classify<BLOCK, false>(cache, len, b0, false, SB, cand, s_res + 7);
    for (int i = threadIdx.x; i < 2048; i += BLOCK) H[i] = 0u;  // digit 2's histogram (H's counts were pushed)
#pragma unroll
    for (int o = 1; o < WS; o <<= 1) {  // the warp's sum reaches its last lane
        const unsigned y = shfl_up(marked, o);
        if (lane >= o) marked += y;
    }
    if (lane == WS - 1 && marked)
        for (unsigned r = rank + 1; r < (unsigned)CL; ++r) red_add_cluster(mapa_u32(smem_u32(s_base), r), marked);
    __syncthreads();
    TRACE(7);
    const unsigned nloc = s_res[7];
    if (threadIdx.x < CL)
        s_goff[threadIdx.x] = nloc ? atom_add_cluster(mapa_u32(smem_u32(s_base + 2), threadIdx.x), nloc) : 0u;
    __syncthreads();
    for (int i = threadIdx.x; i < (int)nloc; i += BLOCK) {
        const unsigned col = cand[i];
        const unsigned key = cache[col];
#pragma unroll 4
        for (int r = 0; r < CL; ++r) st_cluster_v2(mapa_u32(smem_u32(G + 2 * (s_goff[r] + i)), r), key, start + col);
    }
    cluster_sync();  // (2) G holds the cnt1 pairs of the row's threshold bin; s_base[0] is complete
    TRACE(9);
    const int ng = (int)cnt1;
    for (int i = threadIdx.x; i < ng; i += BLOCK) atomicAdd(&H[(G[2 * i] >> 10) & 0x7FFu], 1u);
    __syncthreads();
    select_in<BLOCK, 2048>(H, krem1, s_scan, s_res);
    TRACE(10);
    const unsigned b1 = s_res[0], krem2 = s_res[1], cnt2 = s_res[2];
    const unsigned prefix = (b0 << 21) | (b1 << 10);
    unsigned T = prefix, e = TOPK_ALL;
    if (cnt2 != krem2) {
        for (int i = threadIdx.x; i < ng; i += BLOCK) {
            const unsigned k = G[2 * i];
            if ((k & 0xFFFFFC00u) == prefix) atomicAdd(&H[k & 0x3FFu], 1u);
        }
        __syncthreads();
        select_in<BLOCK, 1024>(H, krem2, s_scan, s_res);
        T = prefix | s_res[0];
        e = s_res[1];
    }
    TRACE(11);
    const int nw = (len + 31) >> 5;
    // H, zero again, becomes the tie bitmap TB
    // This chunk's selected candidates into SB (ties into TB); the lower ranks' counted (packed eq << 16 | gt:
    // at most CL_GATHER_PAIRS each).
    unsigned below = 0;
    for (int i = threadIdx.x; i < ng; i += BLOCK) {
        const unsigned k = G[2 * i];
        const int col = (int)G[2 * i + 1];
        if (col < start) {
            below += (k > T ? 1u : 0u) | (k == T ? 0x10000u : 0u);
        } else if (col < start + len) {
            const unsigned c = (unsigned)(col - start);
            if (k > T || (k == T && e == TOPK_ALL))
                atomicOr(&SB[c >> 5], 1u << (c & 31));
            else if (k == T)
                atomicOr(&H[c >> 5], 1u << (c & 31));
        }
    }
    unsigned total;
    block_excl_scan<BLOCK>(below, total, s_scan + 32);  // its barriers also order the marks before the output
    TRACE(12);
    const unsigned base_gt = s_base[0] + (total & 0xFFFFu), base_eq = total >> 16;
    bitmap_emit<BLOCK>(SB, H, nw, e, base_gt, base_eq, e != TOPK_ALL, start, orow, s_scan, ts);
    TRACE(15);
    return base_gt + umin(base_eq, e);
}

// Which CTA of a cluster writes the row's token tail, and from what: the highest rank
// whose chunk starts at or below the context's end (every group before it keeps all R tokens, none after it any),
// decided after the top-k (writer(), from the sink's limit(): its read hides under the top-k).  A row of at most K
// columns has next < 0: start is the CTA's rank (the first writes), first_slot the row's columns.
struct CtaTail {
    int start, next;       // this CTA's chunk of the row's columns, [start, next)
    long long first_slot;  // this CTA's first output slot
    __device__ __forceinline__ bool writer(long long limit, int R, bool last) const {
        if (next < 0) return start == 0;
        return (long long)start * R <= limit && (last || (long long)next * R > limit);
    }
};

// One cluster of CL CTAs per row.  Shared memory (words): H[2048] local histogram,
// S0[2048] / S1[2048] / S2[1024] cluster-summed histograms of passes 1-3 (filled by remote
// reductions from every CTA), scan[128], res[8], base[8], then the chunk's key cache.
// Cluster barriers: (0) zeroing done before any remote push, (1)-(3) after each pass's pushes,
// (4) after the per-CTA (gt, eq) counts were pushed to higher ranks.  No remote loads.
template <int BLOCK, int U, int CL, class Sink>
__device__ __forceinline__ void cluster_topk(const float* __restrict__ logits, const int* __restrict__ visible,
                                             int* __restrict__ out, int rows, int columns, int ld, int K,
                                             int vec_ok, int cap, int cand_cap, const unsigned* __restrict__ hist,
                                             Sink& ts, CtaTail& tail) {
    TOPK_DYNAMIC_SMEM(smem_cl);
    unsigned* H = smem_cl;
    unsigned* S0 = smem_cl + 2048;
    unsigned* S1 = smem_cl + 4096;
    unsigned* S2 = smem_cl + 6144;
    unsigned* s_scan = smem_cl + 7168;  // 2 x 64
    unsigned* s_res = smem_cl + 7296;   // 8
    unsigned* s_base = smem_cl + 7304;  // 8: [0] gt before this chunk, [1] eq before this chunk
    // fast-path areas: SB bitmap of the chunk (nwcap words), candidate columns (cand_cap x u16)
    const int nwcap = (((cap + 31) >> 5) + 3) & ~3;
    unsigned* SB = smem_cl + CL_FIXED_WORDS;
    unsigned short* cand = reinterpret_cast<unsigned short*>(SB + nwcap);
    unsigned* cache = SB + nwcap + (cand_cap >> 1);
    TRACE_NS(30);
    TRACE(0);
    const int row = blockIdx.x / CL;  // whole cluster shares the row (cluster dims (CL,1,1))
    const unsigned rank = cluster_rank();
    if (row >= rows) return;
    int n = visible[row];
    n = n < 0 ? 0 : (n > columns ? columns : n);
    TRACE(1);
    int* orow = out + (long long)row * K;
    if (n <= K) {  // uniform over the cluster: no DSMEM traffic, every CTA returns here
        ts.fetch_context();
        write_short(orow, n, K, (int)rank * BLOCK + threadIdx.x, CL * BLOCK, ts);
        tail = {(int)rank, -1, n};
        return;
    }
    const int chunk = (((n + CL - 1) / CL) + 3) & ~3;
    const int start = imin(n, (int)rank * chunk);
    const int end = imin(n, start + chunk);
    const int len = end - start;
    const float* g = logits + (long long)row * ld + start;
    const bool vec = vec_ok != 0;
    tail = {start, imin(n, ((int)rank + 1) * chunk), 0};

#if TOPK_BULK
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(smem_cl + CL_MBAR_WORD);
#endif
    // Everything but the mbarriers (thread 0 sets them up, maybe while other threads still zero): the sums, the
    // scratch and the chunk's bitmap.
    for (int i = threadIdx.x; i < CL_MBAR_WORD; i += BLOCK) smem_cl[i] = 0u;
    for (int i = threadIdx.x; i < nwcap; i += BLOCK) smem_cl[CL_FIXED_WORDS + i] = 0u;
    TRACE(2);
    // (0): every CTA's sums are zeroed before any remote push; pass 1 is local, so it runs between the halves
    cluster_arrive();
    const bool count = hist == nullptr;  // else S0 is the scorer's histogram of the whole row
#if TOPK_BULK
    if (vec) {
        bulk_issue(g, len, cache, bars);
        __syncthreads();  // the mbarriers set up, H zeroed
        ts.fetch_context();  // after the barrier: no thread waits for the request id before the row's first loads
        pass_first_bulk<BLOCK>(g, len, cache, H, bars, count);
    } else
#endif
    {
        __syncthreads();  // H zeroed before pass 1 counts into it
        ts.fetch_context();
        pass_first<BLOCK, U>(g, len, vec, cache, H, count);
    }
    if (count) {
        __syncthreads();
        TRACE(3);
        cluster_wait();  // (0)
        TRACE(4);
        push_hist<BLOCK, 2048, CL>(H, S0);
        cluster_sync();  // (1)
        TRACE(5);
    } else {
        const unsigned* hrow = hist + (long long)row * 2048;
        for (int i = threadIdx.x; i < 2048; i += BLOCK) S0[i] = hrow[i];
        cluster_wait();  // (0)
        __syncthreads();
    }
    unsigned T, e;
    {
        unsigned loc[2048 / BLOCK];
        load_loc<BLOCK, 2048>(S0, loc);
        select_bin<BLOCK, 2048>(loc, (unsigned)K, s_scan, s_res);
    }
    const unsigned b0 = s_res[0], krem1 = s_res[1], cnt1 = s_res[2];
    TRACE(6);
    // cnt1 is the cluster-wide count, so this branch is uniform over the cluster
    if (cnt1 != krem1 && cnt1 <= umin(CL_GATHER_PAIRS, (unsigned)cand_cap)) {
        tail.first_slot = gather_finish<BLOCK, CL>(cache, len, start, b0, krem1, cnt1, SB, cand, orow, ts);
        return;
    }
    // cnt1 is the cluster-wide count, so this branch is uniform over the cluster
    if (cnt1 == krem1 || cnt1 <= (unsigned)cand_cap) {
        const bool exhausted1 = cnt1 == krem1;
        pass_classify<BLOCK, false>(cache, len, b0, exhausted1, SB, cand, s_res + 7);
        __syncthreads();
        TRACE(7);
        const int nw = (len + 31) >> 5;
        T = 0;
        e = TOPK_ALL;
        if (!exhausted1) {
            const int ncand = (int)s_res[7];
            const PassCfg c1 = {0xFFE00000u, b0 << 21, 10, 0x7FFu};
            cand_hist<BLOCK>(cache, cand, ncand, H, c1);
            __syncthreads();
            TRACE(8);
            push_hist<BLOCK, 2048, CL>(H, S1);
            cluster_sync();  // (2)
            TRACE(9);
            {
                unsigned loc[2048 / BLOCK];
                load_loc<BLOCK, 2048>(S1, loc);
                select_bin<BLOCK, 2048>(loc, krem1, s_scan, s_res);
            }
            const unsigned b1 = s_res[0], krem2 = s_res[1], cnt2 = s_res[2];
            TRACE(10);
            const unsigned prefix = (b0 << 21) | (b1 << 10);
            if (cnt2 == krem2) {
                T = prefix;
            } else {
                const PassCfg c2 = {0xFFFFFC00u, prefix, 0, 0x3FFu};
                cand_hist<BLOCK>(cache, cand, ncand, H, c2);
                __syncthreads();
                push_hist<BLOCK, 1024, CL>(H, S2);
                cluster_sync();  // (3)
                {
                    unsigned loc[1024 / BLOCK];
                    load_loc<BLOCK, 1024>(S2, loc);
                    select_bin<BLOCK, 1024>(loc, krem2, s_scan, s_res);
                }
                T = prefix | s_res[0];
                e = s_res[1];
            }
            // H, zero again, becomes the tie bitmap TB
            TRACE(11);
            cand_mark<BLOCK>(cache, cand, ncand, T, e, SB, H);
            __syncthreads();
            TRACE(12);
        }
        {
            const int W = (nw + BLOCK - 1) / BLOCK;
            const int w0 = imin(nw, threadIdx.x * W), w1 = imin(nw, w0 + W);
            unsigned tgt, teq;
            block_excl_scan<BLOCK>(popc_words(SB, w0, w1), tgt, s_scan);
            block_excl_scan<BLOCK>(exhausted1 ? 0u : popc_words(H, w0, w1), teq, s_scan + 64);
            const unsigned r = rank + 1 + threadIdx.x;
            if (r < (unsigned)CL) {
                const unsigned a = smem_u32(s_base);
                if (tgt) red_add_cluster(mapa_u32(a, r), tgt);
                if (teq) red_add_cluster(mapa_u32(a + 4u, r), teq);
            }
        }
        TRACE(13);
        cluster_sync();  // (4) after this no CTA touches another CTA's shared memory
        TRACE(14);
        tail.first_slot = s_base[0] + umin(s_base[1], e);
        bitmap_emit<BLOCK>(SB, H, nw, e, s_base[0], s_base[1], e != TOPK_ALL, start, orow, s_scan, ts);
        TRACE(15);
        return;
    }
    if (cnt1 == krem1) {
        T = b0 << 21;
        e = TOPK_ALL;
    } else {
        for (int i = threadIdx.x; i < 2048; i += BLOCK) H[i] = 0u;
        __syncthreads();
        const PassCfg c1 = {0xFFE00000u, b0 << 21, 10, 0x7FFu};
        pass_count<BLOCK, U>(g, cache, len, vec, H, c1, nullptr, nullptr);
        __syncthreads();
        push_hist<BLOCK, 2048, CL>(H, S1);
        cluster_sync();  // (2)
        {
            unsigned loc[2048 / BLOCK];
            load_loc<BLOCK, 2048>(S1, loc);
            select_bin<BLOCK, 2048>(loc, krem1, s_scan, s_res);
        }
        const unsigned b1 = s_res[0], krem2 = s_res[1], cnt2 = s_res[2];
        const unsigned prefix = (b0 << 21) | (b1 << 10);
        if (cnt2 == krem2) {
            T = prefix;
            e = TOPK_ALL;
        } else {
            for (int i = threadIdx.x; i < 1024; i += BLOCK) H[i] = 0u;
            __syncthreads();
            const PassCfg c2 = {0xFFFFFC00u, prefix, 0, 0x3FFu};
            pass_count<BLOCK, U>(g, cache, len, vec, H, c2, nullptr, nullptr);
            __syncthreads();
            push_hist<BLOCK, 1024, CL>(H, S2);
            cluster_sync();  // (3)
            {
                unsigned loc[1024 / BLOCK];
                load_loc<BLOCK, 1024>(S2, loc);
                select_bin<BLOCK, 1024>(loc, krem2, s_scan, s_res);
            }
            T = prefix | s_res[0];
            e = s_res[1];
        }
    }
    // local counts of key > T and key == T in this CTA's chunk, pushed to every higher rank
    {
        unsigned cgt = 0, ceq = 0;
        const int nq = (len + 3) >> 2;
        for (int q = threadIdx.x; q < nq; q += BLOCK) {
            const int nv = quad_valid(len, q);
            uint4 t = *reinterpret_cast<const uint4*>(cache + 4 * q);
            const unsigned kk[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if (i < nv) {
                    cgt += kk[i] > T ? 1u : 0u;
                    ceq += kk[i] == T ? 1u : 0u;
                }
        }
        unsigned tgt, teq;
        block_excl_scan<BLOCK>(cgt, tgt, s_scan);
        block_excl_scan<BLOCK>(ceq, teq, s_scan + 64);
        const unsigned r = rank + 1 + threadIdx.x;
        if (r < (unsigned)CL) {
            const unsigned a = smem_u32(s_base);
            if (tgt) red_add_cluster(mapa_u32(a, r), tgt);
            if (teq) red_add_cluster(mapa_u32(a + 4u, r), teq);
        }
    }
    cluster_sync();  // (4) after this no CTA touches another CTA's shared memory
    tail.first_slot = s_base[0] + umin(s_base[1], e);
    pass_emit<BLOCK, 4>(g, cache, len, vec, start, T, e, s_base[0], s_base[1], orow, (unsigned)K, s_scan, ts);
}

#define TOPK_CL_PARAMS                                                                           \
    const float *__restrict__ logits, const int *__restrict__ visible, int *__restrict__ out,   \
        const void *__restrict__ positions, const void *__restrict__ contexts,                  \
        const void *__restrict__ requests, int *__restrict__ tokens, const unsigned *__restrict__ histogram, \
        int rows, int columns, int ld, int K, int vec_ok, int cap, int cand_cap, int num_requests, int ratio, \
        int width, int tok_ld, int idx_wide
#define TOPK_CL_ARGS logits, visible, out, rows, columns, ld, K, vec_ok, cap, cand_cap, histogram, ts, tail

// One cluster per row: the top-k (each CTA writes its chunk's slots, and with tokens its groups' tokens with them),
// then the tail's CTA writes the row's token tail.
template <int CL>
__device__ __forceinline__ void cluster_kernel(TOPK_CL_PARAMS) {
    TOPK_DYNAMIC_SMEM(smem_cl);
    wait_for_prior_grid();
    const int row = blockIdx.x / CL;
    auto ts = token_sink<true>(row, positions, contexts, requests, row < rows ? tokens : nullptr, num_requests, ratio,
                               tok_ld, idx_wide);
    CtaTail tail = {0, 0, 0};
    cluster_topk<512, 4, CL>(TOPK_CL_ARGS);
    const long long limit = ts.limit();
    if (tokens != nullptr && row < rows && tail.writer(limit, ratio, cluster_rank() == CL - 1)) {  // CTA-uniform
        long long total;
        if (tail.next < 0) {
            total = tail.first_slot * ratio < limit ? tail.first_slot * ratio : limit;
        } else {
            unsigned own;
            block_excl_scan<512>(ts.count, own, smem_cl + 7168 + 96);
            total = tail.first_slot * ratio + own;
        }
        write_tail(ts.trow, ts.p, limit, ratio, total, width, threadIdx.x, 512);
        TRACE(17);
    }
    TRACE(29);
    TRACE_NS(31);
}
#define TOPK_CL_CALL(CL)                                                                                   \
    cluster_kernel<CL>(logits, visible, out, positions, contexts, requests, tokens, histogram, rows, columns, ld, K, \
                       vec_ok, cap, cand_cap, num_requests, ratio, width, tok_ld, idx_wide)

#if !defined(TOPK_SINGLE) || defined(TOPK_KERNEL_topk_cluster2_512)
extern "C" __global__ void __cluster_dims__(2, 1, 1) TOPK_LAUNCH_BOUNDS(512, 2) topk_cluster2_512(TOPK_CL_PARAMS) {
    TOPK_CL_CALL(2);
}
#endif
#if !defined(TOPK_SINGLE) || defined(TOPK_KERNEL_topk_cluster4_512)
extern "C" __global__ void __cluster_dims__(4, 1, 1) TOPK_LAUNCH_BOUNDS(512, 2) topk_cluster4_512(TOPK_CL_PARAMS) {
    TOPK_CL_CALL(4);
}
#endif
#if !defined(TOPK_SINGLE) || defined(TOPK_KERNEL_topk_cluster8_512)
extern "C" __global__ void __cluster_dims__(8, 1, 1) TOPK_LAUNCH_BOUNDS(512, 2) topk_cluster8_512(TOPK_CL_PARAMS) {
    TOPK_CL_CALL(8);
}
#endif
#if !defined(TOPK_NO_CLUSTER16) && (!defined(TOPK_SINGLE) || defined(TOPK_KERNEL_topk_cluster16_512))
extern "C" __global__ void __cluster_dims__(16, 1, 1) TOPK_LAUNCH_BOUNDS(512, 2) topk_cluster16_512(TOPK_CL_PARAMS) {
    TOPK_CL_CALL(16);
}
#endif
#endif  // TOPK_CLUSTERS
