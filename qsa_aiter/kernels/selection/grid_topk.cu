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
// GridLogits, the logits (a fused kernel's source would be a scorer's scores of the same columns, already in the
// keys' area).
// Rows at once: the tail (grid_rows_keys) takes up to GRID_MAX_ROWS rows of a slot together (a fused kernel's row
// group, one request's verify rows); the grid kernels give it one row a call.  The rows share their CTAs' column
// ranges and every barrier below: one arrival a round for all rows still undecided, one counts exchange.
//
// Method (per long row, n > K), on order-preserving keys (grid_key) with digits of 11 + 11 + 10 bits:
//   A  every CTA reads its columns once into shared memory as keys and histograms the top 11 bits there (2048 bins,
//      shared atomics), then adds its non-zero bins to the slot's global histogram (relaxed global atomics).
//   B  a round barrier (grid_round): each CTA adds the bins of every row still undecided to that row's histogram
//      in the slot, fences and arrives once on the slot's counter; the CTA that arrives last reads each such
//      histogram (zeroing it as it reads), finds the row's threshold bin and the rank still to place in it (a
//      block-wide suffix scan), writes each row's (bin, done, rank) in the slot's payload words and publishes the
//      next generation in the flag word (one 64-bit release store; row 0's payload rides in it, so one row costs
//      no extra load); the others wait on the flag (acquire loads), then read the payload words.  A decided row
//      drops out of the rounds; the rounds end when every row is decided (the same payloads in every CTA).
//   R  refinement: while the threshold bin holds more keys than the rank still to place, the same round again over
//      the keys of that bin only (read from shared memory, never from the logits) with the next 11, then 10 bits.
//      The result is a key T and a count e: a column is selected iff key > T, or key == T and it is among the
//      first e columns with key == T (e = all where the whole bin is taken: then T is the bin's lowest key).
//   C  counts: each CTA counts its keys > T and == T and publishes both in its own tagged word of the slot, one a
//      row (no atomic: the tag is the round's generation); CTA j waits for the words of CTAs 0..j-1 only (all rows
//      in one poll, the (row, CTA) pairs spread over its threads), and the prefix
//      gives it its output offset and its share of the ties (ties go to the lower column: CTA j takes the first
//      e - (ties of CTAs < j) of its own).  It then writes its selected columns in column order (block-wide scans
//      of packed per-thread counts; no sort).  The output is the top-K of the row by (-score, column), identical
//      on every repeat and independent of `split` (atomics only count).
//   Expansion (tokens != nullptr): each selected group's tokens go where its slot says (slot * R: every kept group
//      before it is a lower group and keeps all R); the tail starts at the row's kept-token total, which is K * R
//      where the context covers every visible group (limit >= n * R, the case of visible counts from the scorer);
//      otherwise each CTA publishes its token count in a second tagged word and the row's last CTA sums them
//      (every such row of the call in one poll).
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
//   Rows per CTA: slots rows (groups) run at once; a slot's calls run one after another.  The rows of one call
//   share the rounds: a round costs its L2 round trips once (the last CTA reads every undecided row's histogram
//   with its loads in flight together) plus a block scan a row (~0.3 us), so a 4-row group's tail is about one
//   row's plus a few us, not four rows' (estimates, not measured).
// Workspace (unsigned words, GRID_SLOT_WORDS per slot, zeroed once at allocation, reusable without re-zeroing, so
// a CUDA graph replays it with new lengths): histogram[GRID_MAX_ROWS][2048] (zero between rounds: the last CTA
// zeroes what it reads) | arrival counter (zero between rounds: the last CTA resets it) | flag (u64: generation
// << 32 | row 0's payload, only ever increasing) | payload words (one a row, rewritten every round: a CTA reads them
// before it arrives again) | per CTA and row two tagged u64 words (counts, tokens).  Each CTA reads its slot's
// generation once at its start; every round adds one; all CTAs of a slot see the same sequence, so no reset is
// needed.
//
// Kernels (extern "C", dynamic shared memory [H 2048 | scan 64 | res 256 | keys cap] words; the plan that sizes
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
// The most rows one call of the tail takes through the same rounds (a fused kernel's row group).
#define GRID_MAX_ROWS 4
// Workspace slot layout (32-bit words): histograms[GRID_MAX_ROWS][2048] | arrival counter | flag (u64) | payload
// words (one a row) | per CTA and row two tagged u64 words (counts, tokens).
#define GRID_SLOT_WORDS 8800
#define GRID_ARRIVE_WORD 8192
#define GRID_FLAG_WORD 8224
#define GRID_PAYLOAD_WORD 8256
#define GRID_ENTRY_WORD 8288
// Shared-memory layout (32-bit words): H[2048] | scan[64] | res[256] | keys[cap]; scan | res is the tail's own part
// (GRID_TAIL_WORDS: a fused kernel keeps its histograms elsewhere).
#define GRID_FIXED_WORDS 2368
#define GRID_SCAN_WORD 2048
#define GRID_RES_WORD 2112
#define GRID_RES_WORDS 256
#define GRID_TAIL_WORDS 320
#define GRID_TOKEN_LIMIT 2147483648LL
static_assert(GRID_ARRIVE_WORD == GRID_MAX_ROWS * GRID_BINS && GRID_ENTRY_WORD + 4 * GRID_MAX_ROWS * GRID_MAX_SPLIT <=
                  GRID_SLOT_WORDS, "the slot's words");
static_assert(GRID_RES_WORD == GRID_SCAN_WORD + 64 && GRID_TAIL_WORDS == 64 + GRID_RES_WORDS &&
                  GRID_FIXED_WORDS == GRID_BINS + GRID_TAIL_WORDS, "the shared words");

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

// The expansion's arguments of a launch (tokens == nullptr: none), for grid_tokens per row.
struct GridExpand {
    const void* positions;
    const void* contexts;
    const void* requests;
    int* tokens;
    int num_requests, R, tok_ld, idx_wide;
};

__device__ __forceinline__ GridTokens grid_tokens(int row, const GridExpand& x) {
    return grid_tokens(row, x.positions, x.contexts, x.requests, x.tokens, x.num_requests, x.R, x.tok_ld,
                       x.idx_wide);
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
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const int q = q0 + j * BLOCK + threadIdx.x;
            const int nv = grid_quad_valid(len, q);
            if (nv == 4 && vec) {
                const float4 f = __ldg(reinterpret_cast<const float4*>(g + 4 * q));
                v[j][0] = f.x; v[j][1] = f.y; v[j][2] = f.z; v[j][3] = f.w;
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) v[j][i] = i < nv ? __ldg(g + 4 * q + i) : 0.0f;
            }
        }
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const int q = q0 + j * BLOCK + threadIdx.x;
            const int nv = grid_quad_valid(len, q);  // recomputed: fewer registers held across the loads
            if (nv == 0) continue;
            unsigned k[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) k[i] = grid_key(v[j][i]);
            *reinterpret_cast<uint4*>(keys + 4 * q) = make_uint4(k[0], k[1], k[2], k[3]);
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if (i < nv) atomicAdd(&H[k[i] >> 21], 1u);
        }
    }
}

// Quads a thread loads before using any: 4; 3 below sm_90, where 4 spill in the 64 registers the launch bounds leave.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define GRID_LOAD_QUADS 3
#else
#define GRID_LOAD_QUADS 4
#endif

template <int BLOCK>
__device__ __forceinline__ void GridLogits::tile_keys(int row, int col0, int len, unsigned* keys, unsigned* H) const {
    grid_load<BLOCK, GRID_LOAD_QUADS>(logits + (long long)row * ld + col0, len, vec, keys, H);
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
// The tail's rows.  A call takes up to GRID_MAX_ROWS rows (a fused kernel's row group; one row in the grid kernels)
// and keeps each row's state in shared memory (s_res + GRID_RES_STATE + GRID_STATE_WORDS * r), so that the row
// loops hold no per-row value in registers across their barriers.  s_res: [3] last arriver, [5] the slot's generation
// at the kernel's start, [GRID_RES_PAYLOAD + r] row r's payload of the round, [GRID_RES_PEERS + 32 * r + c] the
// value of CTA c for row r (the exchanges).
#define GRID_RES_PAYLOAD 8
#define GRID_RES_STATE 32
#define GRID_STATE_WORDS 16
#define GRID_RES_PEERS 128
#define GS_N 0       // visible count
#define GS_LEN 1     // the CTA's columns of the row
#define GS_MODE 2    // 0: n <= K (written directly, no rounds); 1: in the rounds; 2: decided
#define GS_KREM 3    // the rank still to place
#define GS_PREFIX 4  // the threshold's digits found so far
#define GS_T 5       // the threshold key
#define GS_E 6       // the ties taken at T (GRID_ALL: all)
#define GS_MINE 7    // the CTA's packed counts, then its kept tokens
#define GS_SUM 8     // 1: the row's token total is summed over its CTAs (the context ends inside a kept group)
#define GS_ROW 9     // the row's index
#define GS_COL0 10   // the CTA's first column (every row's)
static_assert(GRID_RES_STATE + GRID_MAX_ROWS * GRID_STATE_WORDS <= GRID_RES_PEERS &&
                  GRID_RES_PEERS + GRID_MAX_ROWS * 32 <= GRID_RES_WORDS && GRID_MAX_SPLIT <= 32,
              "the tail's row states and exchanged values fit res");

// The tagged word of CTA `part` for row r (which 0: counts, 1: tokens).
__device__ __forceinline__ unsigned long long* grid_entry(unsigned* ws, int part, int r, int which) {
    return reinterpret_cast<unsigned long long*>(ws + GRID_ENTRY_WORD) + (part * GRID_MAX_ROWS + r) * 2 + which;
}

// Phase B: one round over NB bins for every row still in the rounds (mode 1), one arrival for all of them.  The CTA
// adds row r's non-zero bins of H + r * GRID_BINS (zeroing them) to the slot's histogram r (ws + r * GRID_BINS) and
// arrives once; the last CTA to arrive reads each such histogram (zeroing it), finds bin b with
// above(b) < krem <= above(b) + G[b] (bins walked from the top: thread t owns bins NB-1-(t*PER+i)), forms the
// payload b | done << 11 | rank << 12 (rank: krem - above(b), or GRID_ALL_FIELD where the whole bin is taken),
// writes rows 1.. into the slot's payload words and publishes generation gen + 1 with row 0's payload in the flag
// (one 64-bit release store); the others wait on the flag (acquire) and then read the payload words.  Leaves the
// payloads in s_res[GRID_RES_PAYLOAD + r], in every CTA of the slot.
template <int BLOCK, int NB>
__device__ __forceinline__ void grid_round(unsigned* ws, int split, int rows, unsigned gen, unsigned* H,
                                           unsigned* s_scan, unsigned* s_res) {
    constexpr int PER = NB / BLOCK;
    constexpr int NW = BLOCK / WS;
    const unsigned* st = s_res + GRID_RES_STATE;
#pragma unroll 1
    for (int r = 0; r < rows; ++r) {
        if (st[r * GRID_STATE_WORDS + GS_MODE] != 1u) continue;
        unsigned* Hr = H + r * GRID_BINS;
        unsigned* G = ws + r * GRID_BINS;
        for (int b = threadIdx.x; b < NB; b += BLOCK) {
            const unsigned c = Hr[b];
            if (c) {
                atomicAdd(G + b, c);
                Hr[b] = 0u;
            }
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
        if (rows > 1) {
            // Several rows: their histograms into their (zero) shared bins first, every row's loads in flight
            // together (one L2 round trip for the group, not one a row); the scans below read them from there.
#pragma unroll
            for (int r = 0; r < GRID_MAX_ROWS; ++r) {
                if (r >= rows || st[r * GRID_STATE_WORDS + GS_MODE] != 1u) continue;
                unsigned* G = ws + r * GRID_BINS;
#pragma unroll
                for (int i = 0; i < PER; ++i) {
                    const int b = NB - 1 - (threadIdx.x * PER + i);
                    H[r * GRID_BINS + b] = (unsigned)load_cg(reinterpret_cast<const int*>(G + b));
                    G[b] = 0u;
                }
            }
        }
        int parity = 0;
#pragma unroll 1
        for (int r = 0; r < rows; ++r) {
            if (st[r * GRID_STATE_WORDS + GS_MODE] != 1u) continue;
            const unsigned krem = st[r * GRID_STATE_WORDS + GS_KREM];
            unsigned* G = ws + r * GRID_BINS;
            unsigned loc[PER], sum = 0;
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                const int b = NB - 1 - (threadIdx.x * PER + i);
                if (rows > 1) {  // staged above by this thread: its own bins, no barrier needed
                    loc[i] = H[r * GRID_BINS + b];
                    H[r * GRID_BINS + b] = 0u;
                } else {
                    loc[i] = (unsigned)load_cg(reinterpret_cast<const int*>(G + b));
                    G[b] = 0u;
                }
                sum += loc[i];
            }
            unsigned total;
            unsigned above = grid_excl_scan<BLOCK>(sum, total, s_scan + parity * (NW + 1));
            parity ^= 1;
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                if (above < krem && above + loc[i] >= krem) {
                    const unsigned rank = krem - above;
                    const unsigned done = rank == loc[i] || NB == 1024 ? 1u : 0u;
                    s_res[GRID_RES_PAYLOAD + r] = (unsigned)(NB - 1 - (threadIdx.x * PER + i)) | done << 11 |
                                                  (rank == loc[i] ? GRID_ALL_FIELD : rank) << 12;
                }
                above += loc[i];
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int r = 1; r < rows; ++r)
                if (st[r * GRID_STATE_WORDS + GS_MODE] == 1u) ws[GRID_PAYLOAD_WORD + r] = s_res[GRID_RES_PAYLOAD + r];
            grid_fence();  // the zeroed bins and counter and the payload words before the flag
            grid_store_release(flag, (unsigned long long)(gen + 1u) << 32 | s_res[GRID_RES_PAYLOAD]);
        }
    } else if (threadIdx.x == 0) {
        unsigned long long w;
        while ((unsigned)((w = grid_load_acquire(flag)) >> 32) != gen + 1u) grid_pause();
        s_res[GRID_RES_PAYLOAD] = (unsigned)w;
        for (int r = 1; r < rows; ++r)
            if (st[r * GRID_STATE_WORDS + GS_MODE] == 1u)
                s_res[GRID_RES_PAYLOAD + r] =
                    (unsigned)load_cg(reinterpret_cast<const int*>(ws + GRID_PAYLOAD_WORD + r));
    }
    __syncthreads();
}

// Phase C's poll: the tagged words `which` of CTAs 0 .. upto-1 for every row with state field `field` set, into
// s_res[GRID_RES_PEERS + 32 * r + c]; the (row, CTA) pairs spread over the CTA's threads.  Ends with a barrier.
template <int BLOCK>
__device__ __forceinline__ void grid_poll(unsigned* ws, int rows, int upto, int which, int field, unsigned tag,
                                          unsigned* s_res) {
    const unsigned* st = s_res + GRID_RES_STATE;
    for (int t = threadIdx.x; t < rows * upto; t += BLOCK) {
        const int r = t / upto, c = t - r * upto;
        if (!st[r * GRID_STATE_WORDS + field]) continue;
        const unsigned long long* word = grid_entry(ws, c, r, which);
        unsigned long long w;
        while ((unsigned)((w = grid_load_acquire(word)) >> 32) != tag) grid_pause();
        s_res[GRID_RES_PEERS + 32 * r + c] = (unsigned)w;
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
// The rounds, the counts and the ordered output of grid_rows_keys' long rows (mode 1; their phase A done, their
// histograms complete).  Sets GS_SUM / GS_MINE of a long row whose token total is summed over its CTAs (published in
// its tagged tokens word).  Returns the slot's generation after the rounds.
template <int BLOCK>
__device__ __forceinline__ unsigned grid_rows_select(int rows, int part, int* __restrict__ out, const GridExpand& x,
                                                     unsigned* ws, int K, int split, unsigned gen, unsigned* H,
                                                     unsigned* s_scan, unsigned* s_res, unsigned* keys, int kstride) {
    constexpr int NW = BLOCK / WS;
    unsigned* st = s_res + GRID_RES_STATE;
    // Rounds: 11 bits, then 11, then 10, for every row until its threshold is exact or its bin is taken whole.
#pragma unroll 1
    for (int d = 0; d < 3; ++d) {
        bool open = false;
        for (int r = 0; r < rows; ++r) open |= st[r * GRID_STATE_WORDS + GS_MODE] == 1u;
        if (!open) break;  // CTA-uniform: every CTA saw the same payloads
        if (d > 0) {
#pragma unroll 1
            for (int r = 0; r < rows; ++r) {
                const unsigned* sr = st + r * GRID_STATE_WORDS;
                if (sr[GS_MODE] != 1u) continue;
                const unsigned* kr = keys + r * kstride;
                if (d == 1)
                    grid_refine_hist<BLOCK>(kr, (int)sr[GS_LEN], H + r * GRID_BINS, 21, sr[GS_PREFIX] >> 21, 10,
                                            0x7FFu);
                else
                    grid_refine_hist<BLOCK>(kr, (int)sr[GS_LEN], H + r * GRID_BINS, 10, sr[GS_PREFIX] >> 10, 0,
                                            0x3FFu);
            }
            __syncthreads();
        }
        if (d == 2)
            grid_round<BLOCK, 1024>(ws, split, rows, gen, H, s_scan, s_res);
        else
            grid_round<BLOCK, 2048>(ws, split, rows, gen, H, s_scan, s_res);
        ++gen;
        if ((int)threadIdx.x < rows) {
            unsigned* sr = st + threadIdx.x * GRID_STATE_WORDS;
            if (sr[GS_MODE] == 1u) {
                const unsigned payload = s_res[GRID_RES_PAYLOAD + threadIdx.x];
                const unsigned prefix = sr[GS_PREFIX] | (payload & 0x7FFu) << (d == 0 ? 21 : (d == 1 ? 10 : 0));
                const unsigned rank = payload >> 12;
                sr[GS_PREFIX] = prefix;
                if ((payload >> 11) & 1u) {
                    sr[GS_T] = prefix;
                    sr[GS_E] = rank == GRID_ALL_FIELD ? GRID_ALL : rank;
                    sr[GS_MODE] = 2u;
                } else {
                    sr[GS_KREM] = rank;
                }
            }
        }
        __syncthreads();
    }

    // Counts: per row, keys > T and == T (each at most chunk <= 32768: one packed word) in the CTA's tagged word;
    // then the lower CTAs' words of every row, in one poll.
    int parity = 0;
#pragma unroll 1
    for (int r = 0; r < rows; ++r) {
        unsigned* sr = st + r * GRID_STATE_WORDS;
        if (!sr[GS_MODE]) continue;
        const unsigned T = sr[GS_T];
        const unsigned* kr = keys + r * kstride;
        const int len = (int)sr[GS_LEN];
        unsigned cgt = 0, ceq = 0;
        for (int i = threadIdx.x; i < len; i += BLOCK) {
            const unsigned k = kr[i];
            cgt += k > T ? 1u : 0u;
            ceq += k == T ? 1u : 0u;
        }
        unsigned packed;
        grid_excl_scan<BLOCK>(ceq << 16 | cgt, packed, s_scan + parity * (NW + 1));
        parity ^= 1;
        if (threadIdx.x == 0) {
            sr[GS_MINE] = packed;
            grid_store_release(grid_entry(ws, part, r, 0), (unsigned long long)gen << 32 | packed);
        }
    }
    grid_poll<BLOCK>(ws, rows, part, 0, GS_MODE, gen, s_res);
    // The ordered output of each row (local: no barrier across CTAs).
#pragma unroll 1
    for (int r = 0; r < rows; ++r) {
        unsigned* sr = st + r * GRID_STATE_WORDS;
        if (!sr[GS_MODE]) continue;
        unsigned base_gt = 0, base_eq = 0;
        for (int i = 0; i < part; ++i) {
            const unsigned v = s_res[GRID_RES_PEERS + 32 * r + i];
            base_gt += v & 0xFFFFu;
            base_eq += v >> 16;
        }
        const unsigned packed = sr[GS_MINE], e = sr[GS_E];
        const unsigned mine_gt = packed & 0xFFFFu, mine_eq = packed >> 16;
        const unsigned ties = e == GRID_ALL ? mine_eq : (e > base_eq ? umin_grid(e - base_eq, mine_eq) : 0u);
        // the row and the CTA's first column from the state (fresh values, not registers held across the phases)
        const int row = (int)sr[GS_ROW];
        const GridTokens ts = grid_tokens(row, x);
        unsigned kept = 0;
        if (mine_gt + ties > 0)  // CTA-uniform
            kept = grid_emit<BLOCK, 4>(keys + r * kstride, (int)sr[GS_LEN], (int)sr[GS_COL0], sr[GS_T], e, base_gt,
                                       base_eq, mine_gt + ties, out + (long long)row * K, ts, s_scan);
        __syncthreads();  // s_scan's and the state's last uses for this row
        if (ts.trow != nullptr && ts.limit < (long long)sr[GS_N] * ts.R) {
            // some kept group may keep fewer than R: the row's total is summed over its CTAs
            unsigned mine;
            grid_excl_scan<BLOCK>(kept, mine, s_scan);
            if (threadIdx.x == 0) {
                sr[GS_MINE] = mine;
                sr[GS_SUM] = 1u;
                grid_store_release(grid_entry(ws, part, r, 1), (unsigned long long)gen << 32 | mine);
            }
            __syncthreads();
        }
    }
    return gen;
}

// ---------------------------------------------------------------------------------------
// The rows row0 .. row0 + rows - 1 (rows <= GRID_MAX_ROWS; counts(r): row r's visible count, read by thread r only),
// part `part` of `split`, their scores from `source` into keys + r * kstride (the CTA's keys area: smem +
// GRID_FIXED_WORDS here, a fused kernel's per-row areas there), histograms in H + r * GRID_BINS (zero on entry, zero
// again on return), the scan and res words in `tail` (GRID_TAIL_WORDS).  The parts' chunk is cut from `basis` >= every
// row's count (here the row's; in a fused kernel the group's widest, so that its rows share their CTAs' column ranges;
// each row's parts still cover [0, n) in order, a part past n holding no column).  The rows with n > K go through the
// same rounds together (one arrival a round for all of them; a decided row drops out) and one counts exchange; the
// others are written directly.  Returns the slot's generation after the rounds.
template <int BLOCK, class Source, class Counts>
__device__ __forceinline__ unsigned grid_rows_keys(int row0, int rows, const Counts& counts, int basis, int part,
                                                   const Source& source, int* __restrict__ out, const GridExpand& x,
                                                   unsigned* ws, int K, int split, int width, unsigned gen,
                                                   unsigned* H, unsigned* tail, unsigned* keys, int kstride) {
    constexpr int NW = BLOCK / WS;
    unsigned* s_scan = tail;
    unsigned* s_res = tail + (GRID_RES_WORD - GRID_SCAN_WORD);
    unsigned* st = s_res + GRID_RES_STATE;
    const int chunk = ((basis + split - 1) / split + GRID_TILE - 1) / GRID_TILE * GRID_TILE;
    const int col0 = part * chunk;
    if ((int)threadIdx.x < rows) {
        const int n = counts((int)threadIdx.x);
        unsigned* sr = st + threadIdx.x * GRID_STATE_WORDS;
        sr[GS_N] = (unsigned)n;
        sr[GS_LEN] = (unsigned)(n - col0 < 0 ? 0 : (n - col0 > chunk ? chunk : n - col0));
        sr[GS_MODE] = n > K ? 1u : 0u;
        sr[GS_KREM] = (unsigned)K;
        sr[GS_PREFIX] = 0u;
        sr[GS_SUM] = 0u;
        sr[GS_ROW] = (unsigned)(row0 + (int)threadIdx.x);
        sr[GS_COL0] = (unsigned)col0;
    }
    __syncthreads();

    // Phase A for the long rows; the short ones (n <= K): every visible group, no score read, the parts sharing the
    // writes (their token tails with the others' at the end).
#pragma unroll 1
    for (int r = 0; r < rows; ++r) {
        const unsigned* sr = st + r * GRID_STATE_WORDS;
        const int n = (int)sr[GS_N];
        if (sr[GS_MODE]) {
            source.template tile_keys<BLOCK>((int)sr[GS_ROW], (int)sr[GS_COL0], (int)sr[GS_LEN], keys + r * kstride,
                                             H + r * GRID_BINS);
            continue;
        }
        const GridTokens ts = grid_tokens((int)sr[GS_ROW], x);
        int* orow = out + (long long)sr[GS_ROW] * K;
        const int first = part * BLOCK + threadIdx.x, stride = split * BLOCK;
        for (int i = first; i < K; i += stride) {
            orow[i] = i < n ? i : -1;
            if (ts.trow != nullptr && i < n) grid_group_tokens(ts, i, i);
        }
    }
    __syncthreads();  // the histograms are complete
    bool any = false;  // read here, not held across phase A
    for (int r = 0; r < rows; ++r) any |= st[r * GRID_STATE_WORDS + GS_MODE] != 0u;
    if (any) {  // CTA-uniform
        gen = grid_rows_select<BLOCK>(rows, part, out, x, ws, K, split, gen, H, s_scan, s_res, keys, kstride);
    }

    // The token tails: after min(n * R, the context) tokens for a short row; after K * R for a long row whose kept
    // groups each keep R; else after the row's summed total (the row's last CTA polls the lower CTAs' totals of every
    // such row at once).
    if (x.tokens != nullptr) {
        const bool last = part == split - 1;
        if (last) grid_poll<BLOCK>(ws, rows, part, 1, GS_SUM, gen, s_res);
#pragma unroll 1
        for (int r = 0; r < rows; ++r) {
            const unsigned* sr = st + r * GRID_STATE_WORDS;
            const GridTokens ts = grid_tokens((int)sr[GS_ROW], x);
            long long total = (long long)K * ts.R;
            int first = part * BLOCK + threadIdx.x, stride = split * BLOCK;
            if (!sr[GS_MODE]) {
                const long long all = (long long)sr[GS_N] * ts.R;
                total = all < ts.limit ? all : ts.limit;
            } else if (sr[GS_SUM]) {
                if (!last) continue;
                total = sr[GS_MINE];
                for (int i = 0; i < part; ++i) total += s_res[GRID_RES_PEERS + 32 * r + i];
                first = threadIdx.x;
                stride = BLOCK;
            }
            grid_tail(ts, total, width, first, stride);
        }
    }
    __syncthreads();  // H, keys and s_res are free for the next call
    return gen;
}

// A single row's visible count (the grid kernels' rows, one a call).
struct GridCount {
    int n;
    __device__ __forceinline__ int operator()(int) const { return n; }
};

// One row of the logits: its visible count read and clamped, its keys in the CTA's keys area.
template <int BLOCK, class Source>
__device__ __forceinline__ unsigned grid_row(int row, int part, const Source& source, const int* __restrict__ visible,
                                             int* __restrict__ out, const GridExpand& x, unsigned* ws, int columns,
                                             int K, int split, int width, unsigned gen, unsigned* smem) {
    int n = visible[row];
    n = n < 0 ? 0 : (n > columns ? columns : n);
    return grid_rows_keys<BLOCK>(row, 1, GridCount{n}, n, part, source, out, x, ws, K, split, width, gen, smem,
                                 smem + GRID_SCAN_WORD, smem + GRID_FIXED_WORDS, 0);
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
    const GridExpand x = {positions, contexts, requests, tokens, num_requests, ratio, tok_ld, idx_wide};
    for (int row = slot; row < rows; row += slots)
        gen = grid_row<BLOCK>(row, part, source, visible, out, x, ws, columns, K, split, width, gen, smem);
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
