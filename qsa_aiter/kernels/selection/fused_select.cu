// fused_select.cu -- the indexer step in one launch: scoring on the tensor cores (native_scorer.cu's tile), the exact
// block top-k of the scores and the expansion to tokens, with no logits in HBM and no CTA waiting on a later one.
//
// Contract (SPEC.md sections 1, 2; qsa_select_paged_tokens for the native scorer's caches: bf16, fp16, fp8 e4m3fn with
// bf16 or fp16 queries, MXFP4 with bf16 queries; 4 heads, head_dim 128): for query row t with visible[t] as
// native_scorer.cu defines it and scores s[t, c] (c < visible[t]) as it computes them,
//   out[t, :]    = the K best columns of [0, visible[t]) ranked by (-s, column), ascending, exactly K (visible <= K:
//                  0 .. visible-1 then -1, nothing scored for such a row alone);
//   tokens[t, :] = their expansion (qsa_expand_block_indices' contract), width = K * R + R - 1 slots.
// The output is exactly the top-K of the kernel's own scores: bitwise the same on every repeat, whatever the split,
// the order in which CTAs finish or the other rows of the call (a row's scores are the scorer's, which do not depend
// on them; the selection is exact over a superset of the top-K and counts with atomics only).  `scores` (null in
// production): a debug output that receives the fp32 scores s[t, c] for c < visible[t] of every row of a row group
// that scores (one of its rows sees more than K columns), rows scores_ld apart.
//
// Work.  The scorer's grid: row_groups * split CTAs of 128 threads, CTA b part b % split of row group b / split (a
// group: group_rows <= 4 consecutive rows, one request's verify rows or one decode row), then, for groups of several
// rows, group_rows - 1 selector CTAs a group (below).  The grid may be larger than what is resident (no cooperative
// launch): no CTA waits for another except a selector for its group's scoring CTAs, of lower index.  A CTA
//   1  loads q of the group as the MMA's A operand and the rows' visible counts (native_scorer.cu's
//      load_query_fragments_of, row_visibility);
//   2  scores its chunk, columns [part * chunk, (part + 1) * chunk) with chunk = round_up(ceil(basis / split), 64) and
//      basis the group's widest visible count, once per distinct request of the group (for_each_request,
//      score_tiles: the scorer's 4-stage cp.async pipeline), its epilogue (store_scores) writing the fp32 scores
//      into a per-row area of shared memory, the stash (and into `scores` where asked);
//   3  offers candidates, for each row that sees more than K columns (fused_offer): turns its scores into
//      order-preserving keys (grid_key) and histograms their top 11 bits in shared memory; adds the non-zero bins at
//      or above the row's published gate (read first: no lower bin can hold the threshold) to the row's histogram in
//      the workspace with returning atomics, so that it learns lower bounds of the row's
//      counts above each bin (its own plus whatever the CTAs before it added); from them the gate: the highest bin
//      with at least K keys at or above it (the row's threshold bin can only be higher: the counts only grow),
//      raised to the row's published gate and published in turn (atomicMax); then writes its keys at or above the
//      gate, (key, column) pairs in ascending columns, into its own area of the row's candidates, and their number
//      into its count word;
//   4  arrives on the group's counter (a fence, then one atomic); the CTA that arrives last (fused_finish) has
//      every candidate of the group's rows: all keys of every bin at or above each row's threshold bin, a superset
//      of the row's top K.  It selects them exactly in shared memory: the threshold's first 11 bits from the row's
//      merged histogram (complete now), then a radix select over the candidates in that bin (11, then 10 bits,
//      stopping where a digit's bin is taken whole), then writes the selected columns in ascending order with the
//      expansion fused: the candidates, read part after part, are in ascending columns, so one ordered compaction
//      (each warp's counts exchanged, then ballots) writes them and gives the ties at the threshold key to the lowest
//      columns; and leaves the row's workspace clean for the next launch.
//      In a group of several rows it selects row 0 only: it first releases the group's selector CTAs (a release
//      store), one a row 1 .. group_rows - 1, which wait for that word and then select their rows the same way at
//      the same time.  A selector waits only on CTAs of lower index, dispatched before it (a single-pass scan's
//      look-back makes the same assumption): they are resident or done, so the wait ends.
// Rows whose visible count is at most K take 0 .. visible-1 from the last arriver, without a score read; a group none
// of whose rows sees more than K columns is not scored at all.
// A cluster plan (`cluster` = split, sm_90+) makes each group's CTAs one thread-block cluster and replaces steps 3-4
// with fused_cluster_tail: the merge, the exact threshold bin and the candidates go through distributed shared
// memory, and the CTA of rank r selects row r; no CTA waits on another cluster, the workspace is not used (measured
// slower than the last arriver's design: fused_select.py's choose_plan never makes one).
//
// Time model (estimates; docs/selection.md has the measured numbers).  The keys: as the scorer's grid reads them,
// each visible key once per row group (256 B a column in bf16, 132 B fp8, 68 B MXFP4 with the scales), the floor
// their bytes over HBM bandwidth.  Added to every CTA after its tiles: the histogram over its chunk in shared memory,
// the returning atomics of its non-zero bins, a block scan of 2048 bins, the
// candidates' stores, a fence and the arrival (~2-3 us, overlapped by the other CTAs' tiles where the grid is larger
// than one wave).  Added once per group, after its last CTA: the merged histogram, the counts and the candidates read
// from L2 (two round trips), a block scan, one or two radix passes over the candidates in shared memory, the ordered
// compaction (~3-5 us a row; a group's rows at the same time, on its last arriver and its selectors).  Candidates:
// each CTA's keys at or above the gate it knows when it offers: all of them
// for the first CTAs of a row (their counts alone do not reach K), then a shrinking share, about K x (1 + ln(CTAs a
// row)) plus the threshold bin's keys for untied scores; constant or heavily tied rows offer more, up to every
// column (the last arriver then reads them from L2 instead of shared memory: slower, never wrong).
// Shared memory: the scorer's stages (64 KB + flags; a quantised stage holds its keys and their scales within a
// 16-bit stage's bytes, so one plan serves every format), the tail's words, and group_rows x cap fp32 scores (the
// stash); after the tiles the stages hold the rows' histograms (4 x 8 KB) and, in the last arriver, the select's
// histogram, the parts' offsets and up to FUSED_CACHE candidates.
//
// Workspace, two buffers (fused_select.py's Plan.workspace_words and Plan.candidate_words):
//   workspace   FUSED_ROW_CLEAN words a row, at the row's index whatever the plan: the arrival counter (a group's
//               first row's word 0), the gate (word 1) and the histogram (words FUSED_ROW_HEAD ..).  Zeroed once and
//               left clean by every launch (the last arriver zeroes what its group used), so calls of any plan share
//               it and a CUDA graph replays it with new lengths.
//   candidates  per row (at the row's index times the plan's scratch_row_words = round_up(split, 4) + 2 * split *
//               cap): a count word a CTA, then a candidates area a CTA (cap (key, column) pairs); never zeroed: every
//               launch writes them before they are read.
//
// Kernels (extern "C"; fused_select.py beside this file declares them): qsa_fused_<bf16|fp16>_page<16|64> (16-bit
// caches), qsa_fused_fp8_<bf16|fp16>_page<16|64> and qsa_fused_fp4_bf16_page<16|64> (the scorer's names).  With
// -DQSA_FUSED_SINGLE -DQSA_FUSED_KERNEL_<name> only <name> is built.  The scorer's and the grid select's own kernels
// are compiled out (QSA_NATIVE_SINGLE, TOPK_SINGLE with no kernel named): this file uses the scorer's tile and the
// grid select's keys, scans and expansion pieces.

#ifndef QSA_NATIVE_SINGLE
#define QSA_NATIVE_SINGLE 1
#endif
#ifndef TOPK_SINGLE
#define TOPK_SINGLE 1
#endif
#include "native_scorer.cu"
#include "grid_topk.cu"

#define QSA_FUSED_THREADS QSA_THREADS
#define QSA_FUSED_CTAS_PER_SM 3
#define FUSED_NW (QSA_FUSED_THREADS / WS)
// The tail's words (after the scorer's shared bytes): two scan buffers, then named words.
#define FUSED_TAIL_WORDS 64
#define FUSED_W_WARPS 12      // per row and warp: the warp's candidates (offer); per warp its kept, then tied (finish)
#define FUSED_W_LAST 32       // 1 in the CTA that arrived last
#define FUSED_W_GATE 36       // per row: the gate bin (offer)
#define FUSED_W_SEL 44        // the radix select's result: bin, rank, count
#define FUSED_W_FIRST 48      // per row: the CTA's first slot among the row's candidates (cluster plans)
#define FUSED_W_TOTAL 52      // per row: the row's candidates (cluster plans)
#define FUSED_STASH_OFFSET (QSA_SHARED_BYTES + FUSED_TAIL_WORDS * 4)
// In the stages, once the tiles are scored (words): the rows' histograms (offer), or in the last arriver the select's
// histogram | the parts' offsets | the candidates' cache.
#define FUSED_HIST_WORD 0
#define FUSED_MERGED_WORD (QSA_MAX_GROUP_ROWS * GRID_BINS)  // cluster plans: rank 0's merged histograms
#define FUSED_MAX_CLUSTER 16
#define FUSED_OFFS_WORD 2048
#define FUSED_MAX_SPLIT 1024
#define FUSED_CACHE_WORD 3080
#ifndef FUSED_CACHE  // (the emulator's tests set fewer, to read the candidates from the workspace)
#define FUSED_CACHE 6652
#endif
// Workspace words a row: the head (a 128-byte line: the gate at word 1; in a group's first row also the arrival
// counter at word 0, the selectors' release word (64-bit) at FUSED_W_RELEASE and their counter at FUSED_W_SELECTED),
// then the histogram.
#define FUSED_ROW_HEAD 32
#define FUSED_W_RELEASE 2
#define FUSED_W_SELECTED 4
#define FUSED_ROW_CLEAN (FUSED_ROW_HEAD + GRID_BINS)

static_assert(QSA_SHARED_BYTES % 16 == 0, "the tail's words and the stash start 16-byte aligned");
static_assert(2 * (FUSED_NW + 1) <= FUSED_W_WARPS && FUSED_W_WARPS + QSA_MAX_GROUP_ROWS * FUSED_NW <= FUSED_W_LAST &&
                  FUSED_W_SEL + 3 <= FUSED_W_FIRST && FUSED_W_TOTAL + QSA_MAX_GROUP_ROWS <= FUSED_TAIL_WORDS,
              "the tail's words");
static_assert(QSA_MAX_GROUP_ROWS <= GRID_MAX_ROWS && QSA_MAX_GROUP_ROWS <= 4, "a word a row in the tail's words");
static_assert(QSA_MAX_GROUP_ROWS * GRID_BINS * 4 <= QSA_FLAGS_OFFSET &&
                  FUSED_HIST_WORD + GRID_BINS <= FUSED_OFFS_WORD &&
                  FUSED_OFFS_WORD + FUSED_MAX_SPLIT + 1 <= FUSED_CACHE_WORD &&
                  FUSED_CACHE_WORD + 2 * FUSED_CACHE <= QSA_FLAGS_OFFSET / 4 &&
                  FUSED_MERGED_WORD + QSA_MAX_GROUP_ROWS * GRID_BINS <= QSA_FLAGS_OFFSET / 4 &&
                  FUSED_MAX_CLUSTER <= FUSED_MAX_SPLIT &&
                  QSA_MAX_GROUP_ROWS * FUSED_MAX_CLUSTER <= QSA_FUSED_THREADS &&
                  QSA_MAX_GROUP_ROWS * FUSED_MAX_CLUSTER <= FUSED_OFFS_WORD,
              "the offer's histograms and the finish's words fit the tile stages");
static_assert(GRID_BINS % QSA_FUSED_THREADS == 0, "whole shares");
static_assert((FUSED_MAX_SPLIT & (FUSED_MAX_SPLIT - 1)) == 0, "the parts' search halves its step");
static_assert(QuantKeys<QSA_KIND_FP8>::SCALES + 4 * QSA_TILE <= QSA_TILE_BYTES &&
                  QuantKeys<QSA_KIND_FP4>::SCALES + 4 * QSA_TILE <= QSA_TILE_BYTES,
              "a quantised stage (keys and their scales) fits a 16-bit stage: one shared-memory plan for every format");

// A row's words: gate and histogram (the workspace), counts and candidates (uint2: key, column; the scratch).
struct FusedRowArea {
    unsigned* gate;
    unsigned* hist;
    unsigned* counts;
    uint2* cands;
};

// Warp w's contiguous range [lo, hi) of n items (whole rounds of WS but the last), so that the warps' ballots, taken
// in order, number the items in order.
struct FusedSpan {
    int lo, hi;
};
__device__ __forceinline__ FusedSpan fused_warp_span(int n, int warp) {
    const int each = ((n + FUSED_NW - 1) / FUSED_NW + WS - 1) / WS * WS;
    const int lo = warp * each < n ? warp * each : n;
    return {lo, lo + each < n ? lo + each : n};
}
// The lanes below `lane` in a ballot's mask.
__device__ __forceinline__ unsigned long long fused_lanes_below(int lane) { return lane ? ~0ull >> (64 - lane) : 0ull; }

// A row's scratch words (fused_select.py's Plan.scratch_row_words): a count word a CTA, padded to 4, then cap
// (key, column) pairs a CTA.
__device__ __forceinline__ int fused_count_words(int split) { return (split + 3) & ~3; }
__device__ __forceinline__ long long fused_scratch_row_words(int split, int cap) {
    return fused_count_words(split) + 2ll * split * cap;
}

// A row group's words: from its first row's in the workspace and the scratch.
struct FusedGroup {
    unsigned* clean;    // the first row's FUSED_ROW_CLEAN words; word 0 the group's arrival counter
    unsigned* scratch;  // the first row's scratch words
    int split, cap;

    __device__ __forceinline__ FusedRowArea row(int r) const {
        unsigned* c = clean + r * FUSED_ROW_CLEAN;
        unsigned* counts = scratch + r * fused_scratch_row_words(split, cap);
        return {c + 1, c + FUSED_ROW_HEAD, counts, reinterpret_cast<uint2*>(counts + fused_count_words(split))};
    }
};

// Scores the CTA's columns [col0, col0 + chunk) of the group's rows into the stash (row i at stash + i * cap: the
// scorer's epilogue over a view whose column col0 is the stash row's word 0), and into `scores` where asked: the
// scorer's walk over the group's distinct requests (for_each_request) and its tile pipeline (score_tiles) over the
// chunk's tiles, keys of format KIND (native_scorer.cu's QSA_KIND_*: q's fragments in its k order, the scale with
// its fp8-in-fp16 factor and the source's scales come from the caller, as score_kernel makes them).  Ends with a
// barrier.
template <int PAGE, bool F16, int KIND>
__device__ __forceinline__ void fused_score(const KeySource& base, const unsigned (&a)[QSA_K_STEPS][4],
                                            const int* s_req, const int* s_vis, int group_rows, long long first_row,
                                            int col0, int chunk, int table_stride, float scale, unsigned char* tiles,
                                            unsigned char* flags, unsigned* stash, int cap, float* scores,
                                            int scores_ld) {
    KeySource src = base;
    float* view = reinterpret_cast<float*>(stash) - col0;
    const unsigned char* table = static_cast<const unsigned char*>(base.page_row);
    for_each_request(s_req, s_vis, group_rows, [&](int req, unsigned mine, int req_visible) {
        src.page_row = request_page_row(table, req, table_stride, src.wide_pages);
        const int last = col0 + chunk < req_visible ? col0 + chunk : req_visible;
        const int begin = col0 / QSA_TILE, end = (last + QSA_TILE - 1) / QSA_TILE;
        score_tiles<PAGE, F16, KIND>(
            src, a, scale, begin, end, req_visible, tiles, flags,
            [&](const float (&acc)[2][4], const unsigned char* tile_flags, int tile) {
                store_scores(acc, view, cap, 0, group_rows, mine, s_vis, tile_flags, tile);
                if (scores != nullptr)
                    store_scores(acc, scores, scores_ld, first_row, group_rows, mine, s_vis, tile_flags, tile);
            });
    });
    __syncthreads();  // the stash is in every thread's view
}

// The CTA's columns of row r: [col0, col0 + len).
__device__ __forceinline__ int fused_len(int n, int col0, int chunk) {
    const int len = n - col0;
    return len < 0 ? 0 : (len > chunk ? chunk : len);
}

// The CTA's keys and histograms, for the group's rows that see more than K columns (bit r of `wide`): turns the
// stash's scores of its columns into order-preserving keys in place and counts their top 11 bits into hist (row r's
// GRID_BINS words at r * GRID_BINS, zeroed here).  Leaves the last histogram's increments unsynchronised.
__device__ __forceinline__ void fused_histograms(const int* s_vis, unsigned wide, int rows, int col0, int chunk,
                                                 int cap, unsigned* hist, unsigned* stash) {
    for (int i = threadIdx.x; i < rows * GRID_BINS; i += QSA_FUSED_THREADS) hist[i] = 0u;
    __syncthreads();
    for (int r = 0; r < rows; ++r) {
        if (!((wide >> r) & 1u)) continue;
        unsigned* S = stash + r * cap;
        unsigned* H = hist + r * GRID_BINS;
        const int len = fused_len(s_vis[r], col0, chunk);
        for (int i = threadIdx.x; i < len; i += QSA_FUSED_THREADS) {
            const unsigned k = grid_key(__uint_as_float(S[i]));
            S[i] = k;
            hist_add_one(H, k >> 21);
        }
    }
}

// The candidates of the CTA's columns: for each row that sees more than K columns, its keys whose top 11 bits are
// at or above the row's gate (tail[FUSED_W_GATE + r]), in column order, so that a row's candidates, read part
// after part, are in ascending columns (the finish writes its output and resolves its ties with one ordered
// compaction).  Warp w takes a contiguous range of the chunk.  Two passes: WRITE false counts a warp's keys a row
// (tail[FUSED_W_WARPS + r * FUSED_NW + w]; ends with a barrier); WRITE true hands each key its slot among the
// CTA's (the warps' exclusive prefix, then the ballot's), put(r, slot, key, column).  fused_offered(tail, r): the
// CTA's count of row r.
template <bool WRITE, class Put>
__device__ __forceinline__ void fused_offers(const int* s_vis, unsigned wide, int rows, int col0, int chunk, int cap,
                                             const unsigned* stash, unsigned* tail, const Put& put) {
    const int lane = threadIdx.x % WS, warp = threadIdx.x / WS;
    for (int r = 0; r < rows; ++r) {
        if (!((wide >> r) & 1u)) continue;
        const unsigned* S = stash + r * cap;
        const unsigned gate = tail[FUSED_W_GATE + r];
        const FusedSpan span = fused_warp_span(fused_len(s_vis[r], col0, chunk), warp);
        unsigned slot = 0;
        for (int w = 0; WRITE && w < warp; ++w) slot += tail[FUSED_W_WARPS + r * FUSED_NW + w];
        for (int b = span.lo; b < span.hi; b += WS) {  // warp-uniform trip count: the ballots see every lane
            const int i = b + lane;
            const unsigned k = i < span.hi ? S[i] : 0u;
            const bool take = i < span.hi && (k >> 21) >= gate;
            const unsigned long long mask = (unsigned long long)warp_ballot(take);
            if (WRITE && take) put(r, slot + (unsigned)__popcll(mask & fused_lanes_below(lane)), k, col0 + i);
            slot += (unsigned)__popcll(mask);
        }
        if (!WRITE && lane == 0) tail[FUSED_W_WARPS + r * FUSED_NW + warp] = slot;
    }
    if (!WRITE) __syncthreads();
}
__device__ __forceinline__ void fused_count_offers(const int* s_vis, unsigned wide, int rows, int col0, int chunk,
                                                   int cap, const unsigned* stash, unsigned* tail) {
    fused_offers<false>(s_vis, wide, rows, col0, chunk, cap, stash, tail, [](int, unsigned, unsigned, int) {});
}
__device__ __forceinline__ unsigned fused_offered(const unsigned* tail, int r) {
    unsigned total = 0;
    for (int w = 0; w < FUSED_NW; ++w) total += tail[FUSED_W_WARPS + r * FUSED_NW + w];
    return total;
}

// Step 3 for the group's rows that see more than K columns (bit r of `wide`): keys and histograms, the merge with
// returning atomics and the gate, the candidates and the count.  Leaves the stash holding keys.
__device__ __forceinline__ void fused_offer(const FusedGroup& g, const int* s_vis, unsigned wide, int rows, int part,
                                            int col0, int chunk, int K, int split, int cap, unsigned* hist,
                                            unsigned* tail, unsigned* stash, unsigned long long* rec) {
    constexpr int PER = GRID_BINS / QSA_FUSED_THREADS;
    // The gate published so far (any value it ever held is a lower bound of the row's threshold bin): loaded first,
    // used after the histograms, so that its round trip overlaps them.
    const bool reads_gate = (int)threadIdx.x < rows && ((wide >> threadIdx.x) & 1u);
    const unsigned published = reads_gate ? (unsigned)load_cg((const int*)g.row(threadIdx.x).gate) : 0u;
    fused_histograms(s_vis, wide, rows, col0, chunk, cap, hist, stash);
    if ((int)threadIdx.x < rows) tail[FUSED_W_GATE + threadIdx.x] = published;
    __syncthreads();
    // The merge: thread t owns bins 2047 - (t * PER + i) of each row; each returned count, plus its own, is a lower
    // bound of the row's final count in that bin.  Returning atomics, not a read before the merge: the CTAs of a
    // wave finish their tiles together, so a read taken before merging sees nothing of theirs (measured: 36-99% of
    // the columns offered, against 6-24% this way).  Only the bins at or above the gate read at the start: the
    // threshold bin is never below it, so no CTA and not the finish needs a lower bin's count (most keys are there).
    unsigned c[QSA_MAX_GROUP_ROWS][PER];
#pragma unroll
    for (int r = 0; r < QSA_MAX_GROUP_ROWS; ++r) {
        const bool on = r < rows && ((wide >> r) & 1u);
        unsigned* G = g.row(r < rows ? r : 0).hist;
        const int floor = on ? (int)tail[FUSED_W_GATE + r] : GRID_BINS;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int b = GRID_BINS - 1 - ((int)threadIdx.x * PER + i);
            c[r][i] = b >= floor ? hist[r * GRID_BINS + b] : 0u;
            if (c[r][i]) c[r][i] += atomicAdd(&G[b], c[r][i]);
        }
    }
    int parity = 0;
#pragma unroll
    for (int r = 0; r < QSA_MAX_GROUP_ROWS; ++r) {
        if (r >= rows || !((wide >> r) & 1u)) continue;  // CTA-uniform
        unsigned sum = 0, total;
#pragma unroll
        for (int i = 0; i < PER; ++i) sum += c[r][i];
        unsigned above = grid_excl_scan<QSA_FUSED_THREADS>(sum, total, tail + parity * (FUSED_NW + 1));
        parity ^= 1;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            if (above < (unsigned)K && above + c[r][i] >= (unsigned)K) {
                const unsigned gate = (unsigned)(GRID_BINS - 1 - ((int)threadIdx.x * PER + i));
                if (gate > tail[FUSED_W_GATE + r]) {  // one thread: the bin where the count crosses K
                    tail[FUSED_W_GATE + r] = gate;
                    atomicMax(g.row(r).gate, gate);
                }
            }
            above += c[r][i];
        }
    }
    __syncthreads();
    qsa_stamp(rec, QSA_STAMP_MERGE);
    fused_count_offers(s_vis, wide, rows, col0, chunk, cap, stash, tail);
    fused_offers<true>(s_vis, wide, rows, col0, chunk, cap, stash, tail,
                       [&](int r, unsigned slot, unsigned k, int col) {
                           g.row(r).cands[(long long)part * cap + slot] = make_uint2(k, (unsigned)col);
                       });
    if ((int)threadIdx.x < rows && ((wide >> threadIdx.x) & 1u))
        g.row(threadIdx.x).counts[part] = fused_offered(tail, threadIdx.x);
}

// The last arriver's view of a row's candidates: the parts' exclusive offsets (offs[0 .. split], in shared memory)
// and either the shared cache (m <= FUSED_CACHE) or the workspace (part p's pairs at cands + p * cap).
struct FusedCands {
    const unsigned* offs;
    const uint2* cache;  // nullptr: read the workspace
    const uint2* cands;
    int split, cap;

    __device__ __forceinline__ uint2 at_global(int j) const {
        // The last part whose offset is <= j (an empty part's offset equals the next one's, so never an empty one):
        // a fixed number of steps, so that a thread's searches for several candidates overlap.
        int lo = 0;
#pragma unroll
        for (int step = FUSED_MAX_SPLIT / 2; step >= 1; step >>= 1)
            if (lo + step < split && (int)offs[lo + step] <= j) lo += step;
        return load_cg(cands + (long long)lo * cap + (j - (int)offs[lo]));
    }
    __device__ __forceinline__ uint2 operator()(int j) const { return cache ? cache[j] : at_global(j); }
};

// A threshold of the radix select: value v is above it iff (v & mask) > prefix; at it iff (v & mask) == prefix
// (all of those taken where `all`, else `rank` of them).
struct FusedThreshold {
    unsigned prefix, mask, rank;
    bool all;
};

// One digit's step of the radix select: thread t holds the counts of bins nb - 1 - (t * per + i) in loc (the bins
// walked from the top); finds the bin where the count from the top reaches t.rank, and narrows t to it (t.all where
// the bin is taken whole).  Two barriers; `parity` picks the scan's buffer.
template <int PER_MAX>
__device__ __forceinline__ void fused_digit(const unsigned (&loc)[PER_MAX], int per, int nb, int shift,
                                            FusedThreshold& t, unsigned* tail, int& parity) {
    unsigned sum = 0, total;
#pragma unroll
    for (int i = 0; i < PER_MAX; ++i) sum += i < per ? loc[i] : 0u;
    unsigned above = grid_excl_scan<QSA_FUSED_THREADS>(sum, total, tail + parity * (FUSED_NW + 1));
    parity ^= 1;
#pragma unroll
    for (int i = 0; i < PER_MAX; ++i) {
        if (i < per && above < t.rank && above + loc[i] >= t.rank) {
            tail[FUSED_W_SEL] = (unsigned)(nb - 1 - ((int)threadIdx.x * per + i));
            tail[FUSED_W_SEL + 1] = t.rank - above;
            tail[FUSED_W_SEL + 2] = loc[i];
        }
        above += i < per ? loc[i] : 0u;
    }
    __syncthreads();
    const unsigned bin = tail[FUSED_W_SEL], rank = tail[FUSED_W_SEL + 1], count = tail[FUSED_W_SEL + 2];
    __syncthreads();  // every thread has read them before the next digit writes them
    t.prefix |= bin << shift;
    t.mask |= ((unsigned)nb - 1u) << shift;
    t.rank = rank;
    t.all = rank == count;
}

// The radix select from digit `first` (0: bits 31..21, 1: bits 20..10, 2: bits 9..0) on: narrows t (the threshold
// after the digits before `first`; t.rank >= 1 values still to place, at least that many at it) over value(j) of the
// candidates j < m with pred(j), a shared histogram of the digit under the prefix found so far a pass; stops where a
// digit's bin is taken whole.
template <class Value, class Pred>
__device__ __forceinline__ FusedThreshold fused_radix(int m, const Value& value, const Pred& pred, FusedThreshold t,
                                                      int first, unsigned* H, unsigned* tail) {
    constexpr int PER_MAX = GRID_BINS / QSA_FUSED_THREADS;
    int parity = 0;
#pragma unroll 1
    for (int d = first; d < 3 && !t.all; ++d) {
        const int shift = d == 0 ? 21 : (d == 1 ? 10 : 0);
        const int nb = d == 2 ? 1024 : 2048;
        const unsigned dmask = (unsigned)nb - 1u;
        for (int b = threadIdx.x; b < nb; b += QSA_FUSED_THREADS) H[b] = 0u;
        __syncthreads();
        for (int j = threadIdx.x; j < m; j += QSA_FUSED_THREADS) {
            if (!pred(j)) continue;
            const unsigned v = value(j);
            if ((v & t.mask) == t.prefix) hist_add_one(H, (v >> shift) & dmask);
        }
        __syncthreads();
        const int per = nb / QSA_FUSED_THREADS;
        unsigned loc[PER_MAX];
#pragma unroll
        for (int i = 0; i < PER_MAX; ++i) loc[i] = i < per ? H[nb - 1 - ((int)threadIdx.x * per + i)] : 0u;
        fused_digit(loc, per, nb, shift, t, tail, parity);
    }
    return t;
}

// A row's exact select and ordered output over its m candidates `cands` (ascending columns), from the threshold's
// first digit `keys`: the radix select's further digits over the candidates in its bin, then the ordered compaction
// with the ties and the expansion (n: the row's visible columns).  H: 2048 words of shared memory.
__device__ __forceinline__ void fused_select_row(const FusedCands& cands, unsigned m, FusedThreshold keys, int n, int K,
                                                 int* __restrict__ orow, const GridTokens& ts, int width,
                                                 unsigned* H, unsigned* tail, unsigned long long* rec) {
    keys = fused_radix((int)m, [&](int j) { return cands(j).x; }, [](int) { return true; }, keys, 1, H, tail);
    qsa_stamp(rec, QSA_STAMP_SELECT);
    // The ordered output: the candidates are in ascending columns (the parts in order, each part's in column order),
    // so one ordered compaction writes the kept columns and gives the ties at the threshold key to the lowest columns
    // (the first keys.rank of them).  Warp w takes a contiguous range; its counts, exchanged, give its offsets.
    const int lane = threadIdx.x % WS, warp = threadIdx.x / WS;
    const FusedSpan span = fused_warp_span((int)m, warp);
    auto classify = [&](int j, bool& above, bool& tie) {
        above = tie = false;
        if (j >= span.hi) return;
        const unsigned km = cands(j).x & keys.mask;
        above = km > keys.prefix || (km == keys.prefix && keys.all);
        tie = km == keys.prefix && !keys.all;
    };
    unsigned n_above = 0, n_tie = 0;
    for (int b = span.lo; b < span.hi; b += WS) {  // warp-uniform trip count: the ballots see every lane
        bool above, tie;
        classify(b + lane, above, tie);
        n_above += (unsigned)__popcll((unsigned long long)warp_ballot(above));
        n_tie += (unsigned)__popcll((unsigned long long)warp_ballot(tie));
    }
    if (lane == 0) {
        tail[FUSED_W_WARPS + warp] = n_above;
        tail[FUSED_W_WARPS + FUSED_NW + warp] = n_tie;
    }
    __syncthreads();
    unsigned above_before = 0, ties_before = 0, kept = 0;
    for (int w = 0; w < warp; ++w) {
        above_before += tail[FUSED_W_WARPS + w];
        ties_before += tail[FUSED_W_WARPS + FUSED_NW + w];
    }
    const unsigned below = fused_lanes_below(lane), rank = keys.rank;
    for (int b = span.lo; b < span.hi; b += WS) {
        bool above, tie;
        classify(b + lane, above, tie);
        const unsigned long long am = (unsigned long long)warp_ballot(above), tm = (unsigned long long)warp_ballot(tie);
        const unsigned a = above_before + (unsigned)__popcll(am & below);
        const unsigned t = ties_before + (unsigned)__popcll(tm & below);
        if (above || (tie && t < rank)) {  // its slot: the kept candidates before it
            const unsigned slot = a + (t < rank ? t : rank);
            const int col = (int)cands(b + lane).y;
            orow[slot] = col;
            if (ts.trow != nullptr) kept += grid_group_tokens(ts, slot, col);
        }
        above_before += (unsigned)__popcll(am);
        ties_before += (unsigned)__popcll(tm);
    }
    if (ts.trow != nullptr) {
        long long total = (long long)K * ts.R;
        if (ts.limit < (long long)n * ts.R) {  // some kept group keeps fewer than R
            unsigned all;
            grid_excl_scan<QSA_FUSED_THREADS>(kept, all, tail);  // (after the barrier of the counts' exchange)
            total = all;
        }
        grid_tail(ts, total, width, threadIdx.x, QSA_FUSED_THREADS);
    }
}

// Step 4 in the last arriver, row r of the group (n > K): the candidates' offsets, the exact select, the ordered
// output with the expansion, the row's workspace left clean.  `smem`: the stages' words.
__device__ __forceinline__ void fused_finish_row(const FusedRowArea& area, int n, int K, int split, int cap,
                                                 int* __restrict__ orow, const GridTokens& ts, int width,
                                                 unsigned* smem, unsigned* tail, unsigned long long* rec) {
    unsigned* H = smem + FUSED_HIST_WORD;
    unsigned* offs = smem + FUSED_OFFS_WORD;
    uint2* cache = reinterpret_cast<uint2*>(smem + FUSED_CACHE_WORD);
    // The row's merged histogram, complete now (every CTA of the group added its bins), gives the first digit of the
    // threshold without a pass over the candidates (whose keys crowd into a few top bins: a shared histogram of them
    // serialises its atomics); its loads go with the counts', and each thread zeroes the bins it read (the
    // workspace is left clean).
    constexpr int PER = GRID_BINS / QSA_FUSED_THREADS;
    unsigned loc[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i)
        loc[i] = (unsigned)load_cg((const int*)area.hist + GRID_BINS - 1 - ((int)threadIdx.x * PER + i));
    // The parts' counts (contiguous shares a thread) and their exclusive prefix.
    const int share = (split + QSA_FUSED_THREADS - 1) / QSA_FUSED_THREADS;
    const int p0 = (int)threadIdx.x * share;
    unsigned sum = 0, m;
    for (int p = p0; p < p0 + share && p < split; ++p) {
        offs[p] = (unsigned)load_cg((const int*)area.counts + p);  // the count, then (below) its part's offset
        sum += offs[p];
    }
    unsigned at = grid_excl_scan<QSA_FUSED_THREADS>(sum, m, tail);
    for (int p = p0; p < p0 + share && p < split; ++p) {
        const unsigned count = offs[p];
        offs[p] = at;
        at += count;
    }
    __syncthreads();
    FusedCands cands = {offs, nullptr, area.cands, split, cap};
    if (m <= FUSED_CACHE) {
        constexpr int U = 8;  // loads in flight a thread
        for (int j0 = threadIdx.x; j0 < (int)m; j0 += U * QSA_FUSED_THREADS) {
            uint2 v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int j = j0 + u * QSA_FUSED_THREADS;
                v[u] = j < (int)m ? cands.at_global(j) : make_uint2(0u, 0u);
            }
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (j0 + u * QSA_FUSED_THREADS < (int)m) cache[j0 + u * QSA_FUSED_THREADS] = v[u];
        }
        cands.cache = cache;
        __syncthreads();
    }
    // The K best keys: the first digit from the merged histogram, the others over the candidates in its bin; then,
    // unless every key at the threshold is taken, the ties to the lowest columns.
    FusedThreshold keys = {0u, 0u, (unsigned)K, false};
    int parity = 1;
    fused_digit(loc, PER, GRID_BINS, 21, keys, tail, parity);
#pragma unroll
    for (int i = 0; i < PER; ++i) area.hist[GRID_BINS - 1 - ((int)threadIdx.x * PER + i)] = 0u;
    qsa_stamp(rec, QSA_STAMP_GATHER);
    fused_select_row(cands, m, keys, n, K, orow, ts, width, H, tail, rec);
    // Leave the row's words clean: the gate (the histogram is zeroed above; the counts and candidates are rewritten).
    if (threadIdx.x == 0) *area.gate = 0u;
    __syncthreads();
}

// Kernel parameters: the pointers, then the scalars (fused_select.py declares them once, PARAMS; every scalar a C
// int).  out: the block indices [rows, K] (a workspace); tokens: the expansion [rows, tok_ld apart]; scores: the
// debug scores or null; stamps: the debug timer records or null (QSA_STAMP_COUNT words a CTA: native_compat.h's
// qsa_stamp); workspace, candidates: the rows' words (above).  k_scale: the quantised caches' per-key scales (4
// bytes a key, where the scorer takes them: after keys; unread for 16-bit caches).  wide: native_scorer.cu's
// QSA_WIDE_* bits.
#define QSA_FUSED_PARAMS                                                                                          \
    const unsigned short *__restrict__ q, const unsigned short *__restrict__ keys,                                 \
        const void *__restrict__ k_scale, const void *__restrict__ page_table,                                     \
        const void *__restrict__ token_to_request, const void *__restrict__ query_positions,                       \
        const void *__restrict__ context_lens, int *__restrict__ out,                                              \
        int *__restrict__ tokens, float *__restrict__ scores, unsigned long long *__restrict__ stamps,             \
        unsigned *workspace, unsigned *candidates, int num_tokens,                                                 \
        int num_requests, int num_pages, int num_columns, int table_width, int table_stride, int page_stride,      \
        int slot_stride, int group_rows, int row_groups, int split, int cluster, int cap, int K, int ratio,        \
        int scale_bits, int wide, int aligned, int width, int tok_ld, int scores_ld
#define QSA_FUSED_ARGS                                                                                            \
    q, keys, k_scale, page_table, token_to_request, query_positions, context_lens, out, tokens, scores, stamps,    \
        workspace, candidates,                                                                                     \
        num_tokens, num_requests, num_pages, num_columns, table_width, table_stride, page_stride, slot_stride,     \
        group_rows, row_groups, split, cluster, cap, K, ratio, scale_bits, wide, aligned, width, tok_ld, scores_ld

// A row that sees at most K columns: 0 .. n-1, then -1, and their expansion (no score read).
__device__ __forceinline__ void fused_short_row(int n, int K, int* __restrict__ orow, const GridTokens& ts,
                                                int width) {
    for (int i = threadIdx.x; i < K; i += QSA_FUSED_THREADS) {
        orow[i] = i < n ? i : -1;
        if (ts.trow != nullptr && i < n) grid_group_tokens(ts, i, i);
    }
    if (ts.trow != nullptr) {
        const long long all = (long long)n * ts.R;
        grid_tail(ts, all < ts.limit ? all : ts.limit, width, threadIdx.x, QSA_FUSED_THREADS);
    }
}

// Rows [r0, r1) of a group after every CTA of it arrived: each row's select and output (fused_finish_row), or for a
// row that sees at most K columns its visible groups.  The gather and select stamps in `rec` are written first (an
// empty range, or rows of at most K columns, have nothing to gather or select), then by each row that selects.
__device__ __forceinline__ void fused_finish_rows(const FusedGroup& g, const int* s_vis, int r0, int r1,
                                                  long long first_row, int K, int split, int cap, int* __restrict__ out,
                                                  const GridExpand& x, int width, unsigned* smem, unsigned* tail,
                                                  unsigned long long* rec) {
    qsa_stamp(rec, QSA_STAMP_GATHER);
    qsa_stamp(rec, QSA_STAMP_SELECT);
#pragma unroll 1
    for (int r = r0; r < r1; ++r) {
        const int n = s_vis[r];
        const int row = (int)first_row + r;
        const GridTokens ts = grid_tokens(row, x);
        int* orow = out + (long long)row * K;
        if (n > K)
            fused_finish_row(g.row(r), n, K, split, cap, orow, ts, width, smem, tail, rec);
        else
            fused_short_row(n, K, orow, ts, width);
    }
}

#if TOPK_CLUSTERS
// Steps 3 and 4 where a group's CTAs are one thread-block cluster (a plan's `cluster`: split CTAs, the CTA's rank its
// part, at least one CTA a row): the merge, the threshold's first digit and the candidates' exchange in distributed
// shared memory, with four cluster barriers and no round trip to L2, and the select of row r on the CTA of rank r.
//   1  every CTA: its keys and histograms (rank 0 zeroes the merged histograms: the stages' second half); barrier;
//   2  each adds its non-zero bins into rank 0's merged histograms (remote reductions); barrier;
//   3  each reads them (remote loads) and finds every row's threshold bin T and the rank in it (the first digit,
//      exact: the merged counts are complete); counts its keys in bins >= T a row and stores the count into the
//      row's selecting CTA's offsets (offs[part]); barrier (after it no one reads the merged histograms);
//   4  each reads the row's counts there, and writes its candidates at their prefix into that CTA's cache (remote
//      stores, column order) or, where the row's candidates overflow the cache, into its part of the workspace's
//      candidates (as the last arriver's design does); barrier;
//   5  the CTA of rank r < rows selects row r from its cache (the radix select's further digits, the ordered
//      compaction with the ties and the expansion), or writes 0 .. visible-1 for a row that sees at most K columns.
// The workspace's counters, gates and histograms are not used (they stay clean).
__device__ __forceinline__ void fused_cluster_tail(const FusedGroup& g, const int* s_vis, unsigned wide, int rows,
                                                   int part, int col0, int chunk, int K, int split, int cap,
                                                   long long first_row, int* __restrict__ out, const GridExpand& x,
                                                   int width, unsigned* smem, unsigned* tail, unsigned* stash,
                                                   unsigned long long* rec) {
    constexpr int PER = GRID_BINS / QSA_FUSED_THREADS;
    unsigned* merged = smem + FUSED_MERGED_WORD;
    unsigned* offs = smem + FUSED_OFFS_WORD;
    uint2* cache = reinterpret_cast<uint2*>(smem + FUSED_CACHE_WORD);
    FusedThreshold mine = {0u, 0u, (unsigned)K, false};  // the first digit of the row this CTA selects
    if (wide) {  // group-uniform: every CTA of the cluster meets the same barriers
        if (part == 0)
            for (int i = threadIdx.x; i < rows * GRID_BINS; i += QSA_FUSED_THREADS) merged[i] = 0u;
        fused_histograms(s_vis, wide, rows, col0, chunk, cap, smem, stash);
        cluster_sync();
        const unsigned merged0 = mapa_u32(smem_u32(merged), 0u);
        for (int r = 0; r < rows; ++r) {
            if (!((wide >> r) & 1u)) continue;
            for (int b = threadIdx.x; b < GRID_BINS; b += QSA_FUSED_THREADS) {
                const unsigned v = smem[r * GRID_BINS + b];
                if (v) red_add_cluster(merged0 + 4u * (unsigned)(r * GRID_BINS + b), v);
            }
        }
        cluster_sync();
        int parity = 0;
        for (int r = 0; r < rows; ++r) {
            if (!((wide >> r) & 1u)) continue;
            unsigned loc[PER];
#pragma unroll
            for (int i = 0; i < PER; ++i)
                loc[i] = ld_cluster_u32(merged0 + 4u * (unsigned)(r * GRID_BINS + GRID_BINS - 1 -
                                                                 ((int)threadIdx.x * PER + i)));
            FusedThreshold t = {0u, 0u, (unsigned)K, false};
            fused_digit(loc, PER, GRID_BINS, 21, t, tail, parity);
            if (threadIdx.x == 0) tail[FUSED_W_GATE + r] = t.prefix >> 21;
            if (r == part) mine = t;
        }
        __syncthreads();
        qsa_stamp(rec, QSA_STAMP_MERGE);
        fused_count_offers(s_vis, wide, rows, col0, chunk, cap, stash, tail);
        if ((int)threadIdx.x < rows && ((wide >> threadIdx.x) & 1u))
            st_cluster_u32(mapa_u32(smem_u32(offs + part), threadIdx.x), fused_offered(tail, threadIdx.x));
        cluster_sync();
        // The rows' counts, a remote load a thread (into the stages' first words, free until the select), then
        // the CTA's first slot and the row's total.
        unsigned* counts = smem;
        if ((int)threadIdx.x < QSA_MAX_GROUP_ROWS * FUSED_MAX_CLUSTER) {
            const int r = (int)threadIdx.x / FUSED_MAX_CLUSTER, p = (int)threadIdx.x % FUSED_MAX_CLUSTER;
            counts[threadIdx.x] = r < rows && p < split && ((wide >> r) & 1u)
                                      ? ld_cluster_u32(mapa_u32(smem_u32(offs + p), (unsigned)r)) : 0u;
        }
        __syncthreads();
        if ((int)threadIdx.x < rows) {
            unsigned before = 0, total = 0;
            for (int p = 0; p < split; ++p) {
                const unsigned c = counts[threadIdx.x * FUSED_MAX_CLUSTER + p];
                before += p < part ? c : 0u;
                total += c;
            }
            tail[FUSED_W_FIRST + threadIdx.x] = before;
            tail[FUSED_W_TOTAL + threadIdx.x] = total;
        }
        __syncthreads();
        fused_offers<true>(s_vis, wide, rows, col0, chunk, cap, stash, tail,
                           [&](int r, unsigned slot, unsigned k, int col) {
                               if (tail[FUSED_W_TOTAL + r] <= FUSED_CACHE)
                                   st_cluster_v2(mapa_u32(smem_u32(cache + tail[FUSED_W_FIRST + r] + slot),
                                                          (unsigned)r),
                                                 k, (unsigned)col);
                               else
                                   g.row(r).cands[(long long)part * cap + slot] = make_uint2(k, (unsigned)col);
                           });
        cluster_sync();
    } else {
        qsa_stamp(rec, QSA_STAMP_MERGE);
    }
    qsa_stamp(rec, QSA_STAMP_OFFER);
    qsa_stamp(rec, QSA_STAMP_ARRIVE);
    if (part >= rows) return;  // CTA-uniform
    const int n = s_vis[part];
    const long long row = first_row + part;
    const GridTokens ts = grid_tokens((int)row, x);
    int* orow = out + row * K;
    qsa_stamp(rec, QSA_STAMP_GATHER);
    if (n <= K) {
        qsa_stamp(rec, QSA_STAMP_SELECT);
        fused_short_row(n, K, orow, ts, width);
    } else {
        // the parts' exclusive offsets in place of their counts (at most FUSED_MAX_CLUSTER of them)
        if (threadIdx.x == 0) {
            unsigned at = 0;
            for (int p = 0; p < split; ++p) {
                const unsigned c = offs[p];
                offs[p] = at;
                at += c;
            }
        }
        __syncthreads();
        const unsigned m = tail[FUSED_W_TOTAL + part];
        const FusedCands cands = {offs, m <= FUSED_CACHE ? cache : nullptr, g.row(part).cands, split, cap};
        fused_select_row(cands, m, mine, n, K, orow, ts, width, smem + FUSED_HIST_WORD, tail, rec);
    }
    qsa_stamp(rec, QSA_STAMP_FINISH);
}
#endif  // TOPK_CLUSTERS

template <int PAGE, bool F16, int KIND>
__device__ __forceinline__ void fused_kernel(QSA_FUSED_PARAMS) {
    TOPK_DYNAMIC_SMEM(smem);
    unsigned char* tiles = reinterpret_cast<unsigned char*>(smem);
    unsigned char* flags = tiles + QSA_FLAGS_OFFSET;
    int* s_req = reinterpret_cast<int*>(tiles + QSA_ROWS_OFFSET);
    int* s_vis = s_req + QSA_MAX_GROUP_ROWS;
    unsigned* tail = reinterpret_cast<unsigned*>(tiles + QSA_SHARED_BYTES);
    unsigned* stash = reinterpret_cast<unsigned*>(tiles + FUSED_STASH_OFFSET);
    wait_for_prior_grid();
    // The grid: row_groups * split scoring CTAs, then (where the plan has them) group_rows - 1 selector CTAs a group,
    // which select rows 1 .. group_rows - 1 while the group's last arriver selects row 0.
    const int scoring = row_groups * split;
    const int selectors = ((int)gridDim.x - scoring) / row_groups;  // a group's: 0 or group_rows - 1
    const bool selector = (int)blockIdx.x >= scoring;
    const int group = selector ? ((int)blockIdx.x - scoring) / selectors : (int)blockIdx.x / split;
    const int part = selector ? 0 : (int)blockIdx.x % split;
    const long long first_row = (long long)group * group_rows;
    unsigned long long* const rec = stamps == nullptr ? nullptr : stamps + (long long)blockIdx.x * QSA_STAMP_COUNT;
    const FusedGroup g = {workspace + first_row * FUSED_ROW_CLEAN,
                          candidates + first_row * fused_scratch_row_words(split, cap), split, cap};
    unsigned long long* const release = reinterpret_cast<unsigned long long*>(g.clean + FUSED_W_RELEASE);
    qsa_stamp(rec, QSA_STAMP_START);
    unsigned a[QSA_K_STEPS][4];
    if (!selector) load_query_fragments_of<KIND>(q, first_row, group_rows, num_tokens, a);
    load_group_rows(token_to_request, query_positions, context_lens, first_row, group_rows, num_tokens, num_requests,
                    num_columns, ratio, wide, s_req, s_vis);
    __syncthreads();
    qsa_stamp(rec, QSA_STAMP_QUERY);
    const int rows = num_tokens - first_row < group_rows ? (int)(num_tokens - first_row) : group_rows;
    // idx_wide for grid_tokens: positions 1, contexts 2, requests 4.
    const int idx_wide = ((wide & QSA_WIDE_POSITIONS) ? 1 : 0) | ((wide & QSA_WIDE_CONTEXTS) ? 2 : 0) |
                         ((wide & QSA_WIDE_REQUESTS) ? 4 : 0);
    const GridExpand x = {query_positions, context_lens, token_to_request, tokens, num_requests, ratio, tok_ld,
                          idx_wide};
    if (selector) {
        // Row r of the group, once its last arriver releases it.  This CTA waits only on CTAs of lower index (its
        // group's scoring CTAs), which are dispatched before it: they are resident or done, as a single-pass scan's
        // look-back assumes, so the wait ends without a cooperative launch.
        const int r = 1 + ((int)blockIdx.x - scoring) % selectors;
        qsa_stamp(rec, QSA_STAMP_SCORE);
        qsa_stamp(rec, QSA_STAMP_MERGE);
        qsa_stamp(rec, QSA_STAMP_OFFER);
        if (threadIdx.x == 0)
            while (grid_load_acquire(release) == 0ull) grid_pause();
        __syncthreads();
        qsa_stamp(rec, QSA_STAMP_ARRIVE);
        // (a row past the call's last: an empty range)
        fused_finish_rows(g, s_vis, r, r < rows ? r + 1 : r, first_row, K, split, cap, out, x, width, smem, tail, rec);
        __syncthreads();
        if (threadIdx.x == 0) {  // the group's last selector leaves the release word and its counter clean
            if (atomicAdd(g.clean + FUSED_W_SELECTED, 1u) == (unsigned)selectors - 1u) {
                g.clean[FUSED_W_SELECTED] = 0u;
                *release = 0ull;
            }
        }
        qsa_stamp(rec, QSA_STAMP_FINISH);
        return;
    }
    int basis = 0;
    unsigned wide_rows = 0;
    for (int i = 0; i < rows; ++i) {
        basis = s_vis[i] > basis ? s_vis[i] : basis;
        wide_rows |= (s_vis[i] > K ? 1u : 0u) << i;
    }
    const int chunk = ((basis + split - 1) / split + GRID_TILE - 1) / GRID_TILE * GRID_TILE;
    const int col0 = part * chunk;
    if (wide_rows) {  // CTA-uniform
        const float scale = score_scale<F16, KIND>(scale_bits);  // the scorer's: fp8 keys in fp16 times 2**8
        const KeySource src = {keys, page_table, (wide & QSA_WIDE_PAGES) != 0, table_width, num_pages, page_stride,
                               slot_stride, aligned != 0, static_cast<const unsigned char*>(k_scale)};
        fused_score<PAGE, F16, KIND>(src, a, s_req, s_vis, group_rows, first_row, col0, chunk, table_stride, scale,
                                     tiles, flags, stash, cap, scores, scores_ld);
    }
    qsa_stamp(rec, QSA_STAMP_SCORE);
#if TOPK_CLUSTERS
    if (cluster) {  // the group's CTAs are one cluster (launch-uniform)
        fused_cluster_tail(g, s_vis, wide_rows, rows, part, col0, chunk, K, split, cap, first_row, out, x, width, smem,
                           tail, stash, rec);
        return;
    }
#endif
    if (wide_rows)
        fused_offer(g, s_vis, wide_rows, rows, part, col0, chunk, K, split, cap, smem, tail, stash, rec);
    else
        qsa_stamp(rec, QSA_STAMP_MERGE);
    qsa_stamp(rec, QSA_STAMP_OFFER);
    __syncthreads();  // every thread's candidates and counts are issued
    if (threadIdx.x == 0) {
        grid_fence();  // release them before the arrival
        const unsigned old = atomicAdd(g.clean, 1u);
        const unsigned last = old == (unsigned)split - 1u ? 1u : 0u;
        if (last) {
            g.clean[0] = 0u;  // every CTA of the group has arrived: the counter is free for the next launch
            grid_fence();      // acquire the other CTAs' candidates
            if (selectors) grid_store_release(release, 1ull);  // the selectors' rows (and all they need) are ready
        }
        tail[FUSED_W_LAST] = last;
    }
    __syncthreads();
    qsa_stamp(rec, QSA_STAMP_ARRIVE);
    if (!tail[FUSED_W_LAST]) return;  // CTA-uniform
    fused_finish_rows(g, s_vis, 0, selectors ? 1 : rows, first_row, K, split, cap, out, x, width, smem, tail, rec);
    qsa_stamp(rec, QSA_STAMP_FINISH);
}

// KIND: native_scorer.cu's QSA_KIND_16BIT, QSA_KIND_FP8 or QSA_KIND_FP4; F16 the query's (and the MMA's) type.
#define QSA_FUSED_KERNEL(name, PAGE, F16, KIND)                                                                   \
    extern "C" __global__ void TOPK_LAUNCH_BOUNDS(QSA_FUSED_THREADS, QSA_FUSED_CTAS_PER_SM)                       \
        name(QSA_FUSED_PARAMS) {                                                                                  \
        fused_kernel<PAGE, F16, KIND>(QSA_FUSED_ARGS);                                                            \
    }

#if !defined(QSA_FUSED_SINGLE) || defined(QSA_FUSED_KERNEL_qsa_fused_bf16_page16)
QSA_FUSED_KERNEL(qsa_fused_bf16_page16, 16, false, QSA_KIND_16BIT)
#endif
#if !defined(QSA_FUSED_SINGLE) || defined(QSA_FUSED_KERNEL_qsa_fused_bf16_page64)
QSA_FUSED_KERNEL(qsa_fused_bf16_page64, 64, false, QSA_KIND_16BIT)
#endif
#if !defined(QSA_FUSED_SINGLE) || defined(QSA_FUSED_KERNEL_qsa_fused_fp16_page16)
QSA_FUSED_KERNEL(qsa_fused_fp16_page16, 16, true, QSA_KIND_16BIT)
#endif
#if !defined(QSA_FUSED_SINGLE) || defined(QSA_FUSED_KERNEL_qsa_fused_fp16_page64)
QSA_FUSED_KERNEL(qsa_fused_fp16_page64, 64, true, QSA_KIND_16BIT)
#endif
#if !defined(QSA_FUSED_SINGLE) || defined(QSA_FUSED_KERNEL_qsa_fused_fp8_bf16_page16)
QSA_FUSED_KERNEL(qsa_fused_fp8_bf16_page16, 16, false, QSA_KIND_FP8)
#endif
#if !defined(QSA_FUSED_SINGLE) || defined(QSA_FUSED_KERNEL_qsa_fused_fp8_bf16_page64)
QSA_FUSED_KERNEL(qsa_fused_fp8_bf16_page64, 64, false, QSA_KIND_FP8)
#endif
#if !defined(QSA_FUSED_SINGLE) || defined(QSA_FUSED_KERNEL_qsa_fused_fp8_fp16_page16)
QSA_FUSED_KERNEL(qsa_fused_fp8_fp16_page16, 16, true, QSA_KIND_FP8)
#endif
#if !defined(QSA_FUSED_SINGLE) || defined(QSA_FUSED_KERNEL_qsa_fused_fp8_fp16_page64)
QSA_FUSED_KERNEL(qsa_fused_fp8_fp16_page64, 64, true, QSA_KIND_FP8)
#endif
#if !defined(QSA_FUSED_SINGLE) || defined(QSA_FUSED_KERNEL_qsa_fused_fp4_bf16_page16)
QSA_FUSED_KERNEL(qsa_fused_fp4_bf16_page16, 16, false, QSA_KIND_FP4)
#endif
#if !defined(QSA_FUSED_SINGLE) || defined(QSA_FUSED_KERNEL_qsa_fused_fp4_bf16_page64)
QSA_FUSED_KERNEL(qsa_fused_fp4_bf16_page64, 64, false, QSA_KIND_FP4)
#endif
