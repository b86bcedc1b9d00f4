// grid_topk.cu -- exact, deterministic block top-k with each row split across several CTAs of one cooperative grid
// ("grid select"): the selection machinery of a fused score + top-k kernel, here reading existing logits.
//
// Contract (per row r of fp32 logits[rows, columns], row stride ld, last dim contiguous), as native_topk.cu's:
//   n = clamp(visible[r], 0, columns)
//   out[r, :] = the K best columns of [0, n) ranked by (-score, column), in ASCENDING column order (exactly K of them);
//               n <= K: 0..n-1 then -1, scores not read.  Columns >= n are never read.
//   -0.0 == +0.0; -inf ranks last but counts; a NaN ranks above +inf whatever its sign and payload, NaNs by column
//   (docs/kernels.md: the key of every NaN is 0xFFFFFFFF, one above +inf's range).
//   With tokens != nullptr the launch also writes each row's token indices (the contract of
//   qsa_expand_block_indices) into tokens[r, 0:width], rows tok_ld apart.
//
// Work.  The launch is a cooperative grid of slots * split CTAs (the launcher passes CU_LAUNCH_ATTRIBUTE_COOPERATIVE,
// so the whole grid is co-resident or the launch fails: the waits below are only safe there).  CTA b is part
// b % split of slot b / split; slot s takes rows s, s + slots, s + 2 * slots, ...; a row's `split` CTAs each own a
// contiguous, GRID_TILE-aligned range of its columns: chunk = round_up(ceil(n / split), GRID_TILE) columns, part j
// the columns [j * chunk, min((j + 1) * chunk, n)).  The score source is a type (phase A below: `tile_keys`): here
// GridLogits, the logits; in the fused kernel (fused_select.cu, through grid_row_keys) the scorer's scores of the
// same columns, already in the keys' area.
//
// Method (per long row, n > K), on order-preserving keys (grid_key) with digits of 11 + 11 + 10 bits:
//   A  every CTA reads its columns once into shared memory as keys and histograms the top 11 bits there (2048 bins,
//      shared atomics), then adds its non-zero bins to the slot's global histogram (relaxed global atomics).
//   B  a round barrier (grid_round): each CTA fences and arrives on the slot's counter; the CTA that arrives last
//      reads the global histogram (zeroing it as it reads), finds the threshold bin and the rank still to place in
//      it (a block-wide suffix scan) and publishes (bin, done, rank) in the slot's flag word with the next
//      generation (one 64-bit release store); the others wait on that word (acquire loads).
//   R  refinement: while the threshold bin holds more keys than the rank still to place, the same round again over
//      the keys of that bin only (read from shared memory, never from the logits) with the next 11, then 10 bits.
//      The result is a key T and a count e: a column is selected iff key > T, or key == T and it is among the
//      first e columns with key == T (e = all where the whole bin is taken: then T is the bin's lowest key).
//   C  counts: each CTA counts its keys > T and == T and publishes both in its own tagged word of the slot (no
//      atomic: the tag is the round's generation); CTA j waits for the words of CTAs 0..j-1 only, and the prefix
//      gives it its output offset and its share of the ties (ties go to the lower column: CTA j takes the first
//      e - (ties of CTAs < j) of its own).  It then writes its selected columns in column order (block-wide scans
//      of packed per-thread counts; no sort).  The output is the top-K of the row by (-score, column), identical
//      on every repeat and independent of `split` (atomics only count).
//   Expansion (tokens != nullptr): each selected group's tokens go where its slot says (slot * R: every kept group
//      before it is a lower group and keeps all R); the tail starts at the row's kept-token total, which is K * R
//      where the context covers every visible group (limit >= n * R, the case of visible counts from the scorer);
//      otherwise each CTA publishes its token count in a second tagged word and the row's last CTA sums them.
//
// Time model (one long row, `split` CTAs; estimates from the native top-k's measured steps, not yet timed here):
//   A   n * 4 bytes from HBM over `split` CTAs (a CTA's read rate is bounded by the loads it keeps in flight, so
//       split CTAs read a row about split times faster) plus a latency of ~1-2 us; the histogram is shared atomics.
//   B   per round: the CTA's non-zero bins as fire-and-forget global reductions (<= 2048), one fence and one
//       atomic round trip to L2 (~0.7 us), the last CTA's read of 2048 bins from L2 (~0.7 us) and its block scan
//       (~0.3 us), the publish and the waiters' poll (~0.5-1 us): ~2.5-3 us a round, 1 to 3 rounds (3 for
//       untied random scores; fewer where a threshold bin is taken whole).
//   R   each refinement round also rescans the CTA's chunk in shared memory (chunk / threads keys a thread).
//   C   one tagged store and a poll of the lower CTAs' words (~1 us), a count and an ordered pass over the chunk.
//   So a decode row costs about (1-2) + 3 x 2.7 + 1 us, flat in its length while chunk stays small: the rounds'
//   L2 round trips dominate; the logits' HBM write and read (and one launch) are what a fused kernel saves.
//   Rows per CTA: slots rows run at once; a slot's rows run one after another.
// Workspace (unsigned words, GRID_SLOT_WORDS per slot, zeroed once at allocation, reusable without re-zeroing, so
// a CUDA graph replays it with new lengths): histogram[2048] (zero between rounds: the last CTA zeroes what it
// reads) | arrival counter (zero between rounds: the last CTA resets it) | flag (u64: generation << 32 | payload,
// only ever increasing) | per CTA two tagged u64 words (counts, tokens).  Each CTA reads its slot's generation
// once at its start; every round adds one; all CTAs of a slot see the same sequence, so no reset is needed.
//
// Kernels (extern "C", dynamic shared memory [H 2048 | scan 64 | res 128 | keys cap] words; the plan that sizes
// them is grid_topk.py beside this file): grid_topk_256, grid_topk_512 (threads per CTA).  With -DTOPK_SINGLE
// -DTOPK_KERNEL_<name> only <name> is built.  The cross-CTA primitives (grid_load_acquire, grid_store_release,
// grid_fence, grid_pause) are native_compat.h's.

#include "native_compat.h"

#define GRID_BINS 2048
#define GRID_TILE 64
#define GRID_MAX_SPLIT 32
// The payload's rank field (20 bits) where every key of the threshold bin is taken.
#define GRID_ALL_FIELD 0xFFFFFu
#define GRID_ALL 0xFFFFFFFFu
// Workspace slot layout (32-bit words).
#define GRID_SLOT_WORDS 2240
#define GRID_ARRIVE_WORD 2048
#define GRID_FLAG_WORD 2080
#define GRID_ENTRY_WORD 2112
// Shared-memory layout (32-bit words): H[2048] | scan[64] | res[128] | keys[cap].
#define GRID_FIXED_WORDS 2240
#define GRID_SCAN_WORD 2048
#define GRID_RES_WORD 2112
#define GRID_TOKEN_LIMIT 2147483648LL

// The order-preserving key of a score: -0.0 as +0.0; every NaN one key above +inf's.
__device__ __forceinline__ unsigned grid_key(float x) {
    unsigned b = __float_as_uint(x);
    b = b == 0x80000000u ? 0u : b;
    const unsigned k = b ^ ((unsigned)((int)b >> 31) | 0x80000000u);
    return (b & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFFFFFFFu : k;
}

__device__ __forceinline__ unsigned umin_grid(unsigned a, unsigned b) { return a < b ? a : b; }

__device__ __forceinline__ int grid_quad_valid(int len, int q) {
    const int r = len - 4 * q;
    return r < 0 ? 0 : (r > 4 ? 4 : r);
}

// Block-wide exclusive scan of one unsigned per thread; `total` gets the block sum; `s` needs BLOCK / WS + 1 words
// (two consecutive calls must use different buffers unless a barrier separates them).
template <int BLOCK>
__device__ __forceinline__ unsigned grid_excl_scan(unsigned v, unsigned& total, unsigned* s) {
    constexpr int NW = BLOCK / WS;
    const int lane = threadIdx.x % WS, warp = threadIdx.x / WS;
    unsigned x = v;
#pragma unroll
    for (int o = 1; o < WS; o <<= 1) {
        const unsigned y = shfl_up(x, o);
        if (lane >= o) x += y;
    }
    if (lane == WS - 1) s[warp] = x;
    __syncthreads();
    if (warp == 0) {
        const unsigned w = lane < NW ? s[lane] : 0u;
        unsigned wi = w;
#pragma unroll
        for (int o = 1; o < NW; o <<= 1) {
            const unsigned y = shfl_up(wi, o);
            if (lane >= o) wi += y;
        }
        if (lane < NW) s[lane] = wi - w;
        if (lane == NW - 1) s[NW] = wi;
    }
    __syncthreads();
    total = s[NW];
    return s[warp] + x - v;
}

// ---------------------------------------------------------------------------------------
// The fused expansion's pieces (the contract of qsa_expand_block_indices): a row's request, position and context
// length, and the tokens of one group.  positions / contexts / requests are int32 or int64 (bits 0 / 1 / 2 of
// idx_wide); a request outside [0, num_requests) keeps no token.
struct GridTokens {
    int* trow;  // the row's token indices; nullptr: no expansion
    long long p, limit;
    int R;
};

__device__ __forceinline__ long long grid_index(const void* p, long long i, bool wide) {
    return wide ? reinterpret_cast<const long long*>(p)[i] : (long long)reinterpret_cast<const int*>(p)[i];
}

__device__ __forceinline__ GridTokens grid_tokens(int row, const void* positions, const void* contexts,
                                                  const void* requests, int* tokens, int num_requests, int R,
                                                  int tok_ld, int idx_wide) {
    GridTokens t = {nullptr, 0, 0, R};
    if (tokens == nullptr) return t;
    const long long req = grid_index(requests, row, idx_wide & 4);
    t.p = grid_index(positions, row, idx_wide & 1);
    t.trow = tokens + (long long)row * tok_ld;
    const long long ctx = req >= 0 && req < num_requests ? grid_index(contexts, req, idx_wide & 2) : 0;
    t.limit = ctx < 0 ? 0 : (ctx > GRID_TOKEN_LIMIT ? GRID_TOKEN_LIMIT : ctx);
    return t;
}

// The tokens of group g at output slot `slot` (those below the context's end); how many.
__device__ __forceinline__ unsigned grid_group_tokens(const GridTokens& t, long long slot, long long g) {
    if (g < 0 || g * t.R >= t.limit) return 0u;
    const long long left = t.limit - g * t.R;
    const unsigned c = (unsigned)(left < t.R ? left : t.R);
    for (unsigned j = 0; j < c; ++j) t.trow[slot * t.R + j] = (int)(g * t.R + j);
    return c;
}

// After the row's `total` group tokens: the causal tail ((p+1)/R)*R .. p below the context's end, then -1 up to
// `width`; slots total + first, total + first + stride, ...
__device__ __forceinline__ void grid_tail(const GridTokens& t, long long total, int width, int first, int stride) {
    const long long start = t.p >= 0 ? (t.p + 1) / t.R * t.R : 0;
    long long len = (t.p + 1 < t.limit ? t.p + 1 : t.limit) - start;
    len = len < 0 ? 0 : len;
    for (long long w = total + first; w < width; w += stride) {
        const long long rel = w - total;
        t.trow[w] = rel < len ? (int)(start + rel) : -1;
    }
}

// ---------------------------------------------------------------------------------------
// Phase A: the score source.  A source is a type with
//   template <int BLOCK> void tile_keys(int row, int col0, int len, unsigned* keys, unsigned* H) const
// that, called by every thread of the CTA, writes the keys (grid_key) of columns col0 .. col0+len-1 of `row` into
// keys[0, len) (whole quads: keys[4q .. 4q+3] for every quad q it touches, the padding past len any value) and adds
// the top 11 bits of each of those len keys into H (2048 shared bins, zero before; shared atomics); col0 is a
// multiple of GRID_TILE.  The selection never reads scores any other way.  GridLogits (below) reads fp32 logits; a
// fused kernel's source scores the tile instead (no logits in HBM).
struct GridLogits {
    const float* __restrict__ logits;
    int ld;       // the row stride (elements)
    bool vec;     // every row starts 16-byte aligned: float4 loads

    template <int BLOCK>
    __device__ __forceinline__ void tile_keys(int row, int col0, int len, unsigned* keys, unsigned* H) const;
};

// The CTA's columns g[0, len) into shared memory as keys, and the histogram of their top 11 bits in H.  U quads a
// thread are loaded before any is used.
template <int BLOCK, int U>
__device__ __forceinline__ void grid_load(const float* __restrict__ g, int len, bool vec, unsigned* keys,
                                          unsigned* H) {
    const int nq = (len + 3) >> 2;
    for (int q0 = 0; q0 < nq; q0 += BLOCK * U) {
        float v[U][4];
        int nv[U];
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const int q = q0 + j * BLOCK + threadIdx.x;
            nv[j] = grid_quad_valid(len, q);
            if (nv[j] == 4 && vec) {
                const float4 f = __ldg(reinterpret_cast<const float4*>(g + 4 * q));
                v[j][0] = f.x; v[j][1] = f.y; v[j][2] = f.z; v[j][3] = f.w;
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) v[j][i] = i < nv[j] ? __ldg(g + 4 * q + i) : 0.0f;
            }
        }
#pragma unroll
        for (int j = 0; j < U; ++j) {
            if (nv[j] == 0) continue;
            const int q = q0 + j * BLOCK + threadIdx.x;
            unsigned k[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) k[i] = grid_key(v[j][i]);
            *reinterpret_cast<uint4*>(keys + 4 * q) = make_uint4(k[0], k[1], k[2], k[3]);
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if (i < nv[j]) atomicAdd(&H[k[i] >> 21], 1u);
        }
    }
}

template <int BLOCK>
__device__ __forceinline__ void GridLogits::tile_keys(int row, int col0, int len, unsigned* keys, unsigned* H) const {
    grid_load<BLOCK, 4>(logits + (long long)row * ld + col0, len, vec, keys, H);
}

// A refinement round's local histogram: the keys with (key >> shift_hi) == want, by digit (key >> shift) & dmask.
template <int BLOCK>
__device__ __forceinline__ void grid_refine_hist(const unsigned* keys, int len, unsigned* H, int shift_hi,
                                                 unsigned want, int shift, unsigned dmask) {
    const int nq = (len + 3) >> 2;
    for (int q = threadIdx.x; q < nq; q += BLOCK) {
        const uint4 t = *reinterpret_cast<const uint4*>(keys + 4 * q);
        const unsigned k[4] = {t.x, t.y, t.z, t.w};
        const int nv = grid_quad_valid(len, q);
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (i < nv && (k[i] >> shift_hi) == want) atomicAdd(&H[(k[i] >> shift) & dmask], 1u);
    }
}

// ---------------------------------------------------------------------------------------
// Phase B: one round over NB bins.  The CTA adds its non-zero bins of H (zeroing them) to the slot's histogram G and
// arrives; the last CTA to arrive reads G (zeroing it), finds bin b with above(b) < krem <= above(b) + G[b] (bins
// walked from the top: thread t owns bins NB-1-(t*PER+i)) and publishes generation gen + 1 with the payload
// b | done << 11 | rank << 12 (rank: krem - above(b), or GRID_ALL_FIELD where the whole bin is taken).  Returns the
// payload, in every thread of every CTA of the row.
template <int BLOCK, int NB>
__device__ __forceinline__ unsigned grid_round(unsigned* ws, int split, unsigned krem, unsigned gen, unsigned* H,
                                               unsigned* s_scan, unsigned* s_res) {
    constexpr int PER = NB / BLOCK;
    for (int b = threadIdx.x; b < NB; b += BLOCK) {
        const unsigned c = H[b];
        if (c) {
            atomicAdd(ws + b, c);
            H[b] = 0u;
        }
    }
    unsigned long long* flag = reinterpret_cast<unsigned long long*>(ws + GRID_FLAG_WORD);
    __syncthreads();  // every thread's adds are issued
    if (threadIdx.x == 0) {
        grid_fence();  // release them before the arrival
        const unsigned old = atomicAdd(ws + GRID_ARRIVE_WORD, 1u);
        const unsigned last = old == (unsigned)split - 1u ? 1u : 0u;
        if (last) {
            ws[GRID_ARRIVE_WORD] = 0u;  // nobody arrives again before the flag moves
            grid_fence();               // acquire the other CTAs' adds
        }
        s_res[3] = last;
    }
    __syncthreads();
    if (s_res[3]) {  // CTA-uniform: the last CTA
        unsigned loc[PER], sum = 0;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int b = NB - 1 - (threadIdx.x * PER + i);
            loc[i] = (unsigned)load_cg(reinterpret_cast<const int*>(ws + b));
            ws[b] = 0u;
            sum += loc[i];
        }
        unsigned total;
        unsigned above = grid_excl_scan<BLOCK>(sum, total, s_scan);
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            if (above < krem && above + loc[i] >= krem) {
                const unsigned rank = krem - above;
                const unsigned done = rank == loc[i] || NB == 1024 ? 1u : 0u;
                s_res[4] = (unsigned)(NB - 1 - (threadIdx.x * PER + i)) | done << 11 |
                           (rank == loc[i] ? GRID_ALL_FIELD : rank) << 12;
            }
            above += loc[i];
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            grid_fence();  // the zeroed bins and counter before the flag
            grid_store_release(flag, (unsigned long long)(gen + 1u) << 32 | s_res[4]);
        }
    } else if (threadIdx.x == 0) {
        unsigned long long w;
        while ((unsigned)((w = grid_load_acquire(flag)) >> 32) != gen + 1u) grid_pause();
        s_res[4] = (unsigned)w;
    }
    __syncthreads();
    return s_res[4];
}

// Phase C's exchange: publish this CTA's value in its tagged word `which` (0: counts, 1: tokens) and return the
// values of CTAs 0 .. upto-1 in s_res[32 + i] (warp 0 polls them, one lane a CTA).  Ends with a barrier.
__device__ __forceinline__ void grid_exchange(unsigned* ws, int part, int upto, int which, unsigned tag,
                                              unsigned value, unsigned* s_res) {
    unsigned long long* entries = reinterpret_cast<unsigned long long*>(ws + GRID_ENTRY_WORD);
    if (threadIdx.x == 0) grid_store_release(entries + 2 * part + which, (unsigned long long)tag << 32 | value);
    if (threadIdx.x < upto) {
        unsigned long long w;
        while ((unsigned)((w = grid_load_acquire(entries + 2 * threadIdx.x + which)) >> 32) != tag) grid_pause();
        s_res[32 + threadIdx.x] = (unsigned)w;
    }
    __syncthreads();
}

// The ordered output pass over the CTA's keys[0, len) (columns col0 + i): a key > T goes to slot
// gt + min(eq, e), a key == T to slot gt + eq while eq < e, where gt / eq count the keys > T / == T before it in the
// row (base_gt / base_eq: those of lower CTAs).  Each thread owns EU consecutive quads of a tile of BLOCK * EU quads;
// a block scan of packed (eq << 16 | gt) counts (<= 16 * BLOCK a tile) places them.  Stops after `selected` columns.
template <int BLOCK, int EU>
__device__ __forceinline__ unsigned grid_emit(const unsigned* keys, int len, int col0, unsigned T, unsigned e,
                                              unsigned base_gt, unsigned base_eq, unsigned selected, int* orow,
                                              const GridTokens& ts, unsigned* s_scan) {
    constexpr int NW = BLOCK / WS;
    const unsigned end = base_gt + umin_grid(base_eq, e) + selected;
    const int nq = (len + 3) >> 2;
    unsigned kept_tokens = 0;
    int parity = 0;
    for (int q0 = 0; q0 < nq; q0 += BLOCK * EU) {
        if (base_gt + umin_grid(base_eq, e) >= end) break;  // block-uniform
        unsigned k[EU][4];
        int nv[EU];
        unsigned cgt = 0, ceq = 0;
#pragma unroll
        for (int j = 0; j < EU; ++j) {
            const int q = q0 + threadIdx.x * EU + j;
            nv[j] = grid_quad_valid(len, q);
            if (nv[j] > 0) {
                const uint4 t = *reinterpret_cast<const uint4*>(keys + 4 * q);
                k[j][0] = t.x; k[j][1] = t.y; k[j][2] = t.z; k[j][3] = t.w;
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if (i < nv[j]) {
                    cgt += k[j][i] > T ? 1u : 0u;
                    ceq += k[j][i] == T ? 1u : 0u;
                }
            }
        }
        unsigned tot;
        const unsigned ex = grid_excl_scan<BLOCK>(ceq << 16 | cgt, tot, s_scan + parity * (NW + 1));
        parity ^= 1;
        unsigned gt = base_gt + (ex & 0xFFFFu), eq = base_eq + (ex >> 16);
        if (cgt | ceq) {
#pragma unroll
            for (int j = 0; j < EU; ++j) {
                const int q = q0 + threadIdx.x * EU + j;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    if (i >= nv[j]) continue;
                    const unsigned kk = k[j][i];
                    const int col = col0 + 4 * q + i;
                    if (kk > T) {
                        const unsigned slot = gt + umin_grid(eq, e);
                        orow[slot] = col;
                        if (ts.trow != nullptr) kept_tokens += grid_group_tokens(ts, slot, col);
                        ++gt;
                    } else if (kk == T) {
                        if (eq < e) {
                            orow[gt + eq] = col;
                            if (ts.trow != nullptr) kept_tokens += grid_group_tokens(ts, gt + eq, col);
                        }
                        ++eq;
                    }
                }
            }
        }
        base_gt += tot & 0xFFFFu;
        base_eq += tot >> 16;
    }
    return kept_tokens;
}

// ---------------------------------------------------------------------------------------
// One row of n visible columns, part `part` of `split`, its scores from `source` into `keys` (the CTA's keys area:
// smem + GRID_FIXED_WORDS here, a fused kernel's per-row area there).  The parts' chunk is cut from `basis` >= n
// (here n; in a fused kernel the row group's widest row, so that its rows share their CTAs' column ranges; the parts
// still cover [0, n) in order, a part past n holding no column).  Returns the slot's generation after the rounds.
template <int BLOCK, class Source>
__device__ __forceinline__ unsigned grid_row_keys(int row, int n, int basis, int part, const Source& source,
                                                  int* __restrict__ out, const GridTokens& ts, unsigned* ws, int K,
                                                  int split, int width, unsigned gen, unsigned* smem,
                                                  unsigned* keys) {
    unsigned* H = smem;
    unsigned* s_scan = smem + GRID_SCAN_WORD;
    unsigned* s_res = smem + GRID_RES_WORD;
    int* orow = out + (long long)row * K;
    if (n <= K) {  // every visible group, no score read; the row's parts share the writes
        const int first = part * BLOCK + threadIdx.x, stride = split * BLOCK;
        for (int i = first; i < K; i += stride) {
            orow[i] = i < n ? i : -1;
            if (ts.trow != nullptr && i < n) grid_group_tokens(ts, i, i);
        }
        if (ts.trow != nullptr) {
            const long long all = (long long)n * ts.R;
            grid_tail(ts, all < ts.limit ? all : ts.limit, width, first, stride);
        }
        return gen;
    }
    const int chunk = ((basis + split - 1) / split + GRID_TILE - 1) / GRID_TILE * GRID_TILE;
    const int col0 = part * chunk;
    const int len = n - col0 < 0 ? 0 : (n - col0 > chunk ? chunk : n - col0);
    source.template tile_keys<BLOCK>(row, col0, len, keys, H);
    __syncthreads();

    // Rounds: 11 bits, then 11, then 10, until the threshold is exact or its bin is taken whole.
    unsigned krem = (unsigned)K, prefix = 0u, T = 0u, e = GRID_ALL;
    for (int d = 0; d < 3; ++d) {
        if (d == 1) {
            grid_refine_hist<BLOCK>(keys, len, H, 21, prefix >> 21, 10, 0x7FFu);
            __syncthreads();
        } else if (d == 2) {
            grid_refine_hist<BLOCK>(keys, len, H, 10, prefix >> 10, 0, 0x3FFu);
            __syncthreads();
        }
        const unsigned payload = d == 2 ? grid_round<BLOCK, 1024>(ws, split, krem, gen, H, s_scan, s_res)
                                        : grid_round<BLOCK, 2048>(ws, split, krem, gen, H, s_scan, s_res);
        ++gen;
        prefix |= (payload & 0x7FFu) << (d == 0 ? 21 : (d == 1 ? 10 : 0));
        const unsigned rank = payload >> 12;
        if ((payload >> 11) & 1u) {
            T = prefix;
            e = rank == GRID_ALL_FIELD ? GRID_ALL : rank;
            break;
        }
        krem = rank;
    }

    // Counts: keys > T and == T (each at most chunk <= 32768: one packed word), the lower CTAs' from their words.
    unsigned cgt = 0, ceq = 0;
    for (int i = threadIdx.x; i < len; i += BLOCK) {
        const unsigned k = keys[i];
        cgt += k > T ? 1u : 0u;
        ceq += k == T ? 1u : 0u;
    }
    unsigned packed;
    grid_excl_scan<BLOCK>(ceq << 16 | cgt, packed, s_scan);
    grid_exchange(ws, part, part, 0, gen, packed, s_res);
    unsigned base_gt = 0, base_eq = 0;
    for (int i = 0; i < part; ++i) {
        base_gt += s_res[32 + i] & 0xFFFFu;
        base_eq += s_res[32 + i] >> 16;
    }
    const unsigned mine_gt = packed & 0xFFFFu, mine_eq = packed >> 16;
    const unsigned ties = e == GRID_ALL ? mine_eq : (e > base_eq ? umin_grid(e - base_eq, mine_eq) : 0u);
    unsigned kept = 0;
    if (mine_gt + ties > 0)  // CTA-uniform
        kept = grid_emit<BLOCK, 4>(keys, len, col0, T, e, base_gt, base_eq, mine_gt + ties, orow, ts, s_scan);
    if (ts.trow != nullptr) {
        long long total = (long long)K * ts.R;
        if (ts.limit < (long long)n * ts.R) {  // some kept group may keep fewer than R: the row's total, summed
            unsigned mine;
            __syncthreads();  // s_scan's last use by grid_emit
            grid_excl_scan<BLOCK>(kept, mine, s_scan);
            const bool last = part == split - 1;
            grid_exchange(ws, part, last ? part : 0, 1, gen, mine, s_res);
            total = mine;
            if (last)
                for (int i = 0; i < part; ++i) total += s_res[32 + i];
            if (last) grid_tail(ts, total, width, threadIdx.x, BLOCK);
        } else {
            grid_tail(ts, total, width, part * BLOCK + threadIdx.x, split * BLOCK);
        }
    }
    __syncthreads();  // H, keys and s_res are free for the next row
    return gen;
}

// One row of the logits: its visible count read and clamped, its keys in the CTA's keys area.
template <int BLOCK, class Source>
__device__ __forceinline__ unsigned grid_row(int row, int part, const Source& source, const int* __restrict__ visible,
                                             int* __restrict__ out, const GridTokens& ts, unsigned* ws, int columns,
                                             int K, int split, int width, unsigned gen, unsigned* smem) {
    int n = visible[row];
    n = n < 0 ? 0 : (n > columns ? columns : n);
    return grid_row_keys<BLOCK>(row, n, n, part, source, out, ts, ws, K, split, width, gen, smem,
                                smem + GRID_FIXED_WORDS);
}

// Kernel parameters: the pointers, then the scalars (the launcher passes them in this order).  tokens == nullptr: no
// expansion (positions, contexts, requests and the last five scalars are unread).
#define GRID_PARAMS                                                                                            \
    const float *__restrict__ logits, const int *__restrict__ visible, int *__restrict__ out,                 \
        const void *__restrict__ positions, const void *__restrict__ contexts,                                \
        const void *__restrict__ requests, int *__restrict__ tokens, unsigned *workspace, int rows,            \
        int columns, int ld, int K, int split, int slots, int cap, int vec_ok, int num_requests, int ratio,    \
        int width, int tok_ld, int idx_wide

template <int BLOCK>
__device__ __forceinline__ void grid_kernel(GRID_PARAMS) {
    TOPK_DYNAMIC_SMEM(smem);
    const int part = blockIdx.x % split, slot = blockIdx.x / split;
    unsigned* ws = workspace + (long long)slot * GRID_SLOT_WORDS;
    for (int i = threadIdx.x; i < GRID_BINS; i += BLOCK) smem[i] = 0u;
    if (threadIdx.x == 0)
        smem[GRID_RES_WORD + 5] =
            (unsigned)(grid_load_acquire(reinterpret_cast<const unsigned long long*>(ws + GRID_FLAG_WORD)) >> 32);
    __syncthreads();
    unsigned gen = smem[GRID_RES_WORD + 5];
    __syncthreads();
    (void)cap;  // the plan's bound on chunk (the keys' room); the chunk is recomputed per row
    const GridLogits source = {logits, ld, vec_ok != 0};
    for (int row = slot; row < rows; row += slots) {
        const GridTokens ts = grid_tokens(row, positions, contexts, requests, tokens, num_requests, ratio, tok_ld,
                                          idx_wide);
        gen = grid_row<BLOCK>(row, part, source, visible, out, ts, ws, columns, K, split, width, gen, smem);
    }
}

#define GRID_CALL(BLOCK)                                                                                   \
    grid_kernel<BLOCK>(logits, visible, out, positions, contexts, requests, tokens, workspace, rows, columns, ld, \
                       K, split, slots, cap, vec_ok, num_requests, ratio, width, tok_ld, idx_wide)

#if !defined(TOPK_SINGLE) || defined(TOPK_KERNEL_grid_topk_256)
extern "C" __global__ void TOPK_LAUNCH_BOUNDS(256, 4) grid_topk_256(GRID_PARAMS) {
    GRID_CALL(256);
}
#endif
#if !defined(TOPK_SINGLE) || defined(TOPK_KERNEL_grid_topk_512)
extern "C" __global__ void TOPK_LAUNCH_BOUNDS(512, 2) grid_topk_512(GRID_PARAMS) {
    GRID_CALL(512);
}
#endif
