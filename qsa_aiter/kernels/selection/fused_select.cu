// fused_select.cu -- the indexer step in one launch: scoring on the tensor cores (native_scorer.cu's tile), the exact
// block top-k of the scores (grid_topk.cu's grid select) and the expansion to tokens, with no logits in HBM.
//
// Contract (SPEC.md sections 1, 2; qsa_select_paged_tokens for the native scorer's caches: bf16, fp16, fp8 e4m3fn with
// bf16 or fp16 queries, MXFP4 with bf16 queries; 4 heads, head_dim 128): for query row t with visible[t] as
// native_scorer.cu defines it and scores s[t, c] (c < visible[t]) as it computes them,
//   out[t, :]    = the K best columns of [0, visible[t]) ranked by (-s, column), ascending, exactly K (visible <= K:
//                  0 .. visible-1 then -1, nothing scored for such a row alone);
//   tokens[t, :] = their expansion (qsa_expand_block_indices' contract), width = K * R + R - 1 slots.
// The output is exactly the top-K of the kernel's own scores: bitwise the same on every repeat, whatever the split,
// the thread order or the other rows of the call (a row's scores are the scorer's, which do not depend on them; the
// selection counts with atomics only).  `scores` (null in production): a debug output that receives the fp32 scores
// s[t, c] for c < visible[t] of every row of a row group that scores (one of its rows sees more than K columns), rows
// scores_ld apart; tests check the output against the torch top-k of these, and these against the oracle.
//
// Work.  A cooperative grid of slots * split CTAs of 128 threads (the launcher passes CU_LAUNCH_ATTRIBUTE_COOPERATIVE:
// the whole grid is co-resident or the launch fails).  CTA b is part b % split of slot b / split; slot s takes the row
// groups s, s + slots, ... (a group: group_rows <= 4 consecutive rows, which the host sizes to one request's rows, as
// the scorer's).  For its group, a CTA
//   1  loads q of the group as the MMA's A operand, in the k order of the cache's format, and the rows' visible
//      counts (native_scorer.cu: load_query_fragments_of, row_visibility);
//   2  cuts the group's columns [0, basis), basis = the group's widest visible count, into `split` GRID_TILE-aligned
//      chunks (grid_topk.cu's chunk, from basis instead of the row's count: every row of the group shares the CTA's
//      column range, so one pass over the keys scores all of them), and scores its chunk's 64-column tiles once per
//      distinct request of the group with the scorer's own functions (for_each_request, the walk over the requests;
//      score_tiles, the 4-stage cp.async pipeline: stage_tile, score_tile or score_quant_tile, head_sums with the
//      scorer's factor score_scale, scale_columns for fp8's per-key scales), its epilogue the scorer's
//      (store_scores) writing the fp32 scores into a per-row area of shared memory (`stash`, group_rows x cap words)
//      instead of HBM (and into `scores` where asked);
//   3  runs the grid select's tail once for the whole group (grid_rows_keys): per row, the source FusedKeys turns
//      the row's scores into order-preserving keys in place and histograms them (phase A, a histogram a row in the
//      tile stages, free once the group is scored); then the group's rows go through the same rounds (one arrival a
//      round for every row still undecided), one tagged counts exchange, and the ordered output per row with the
//      expansion fused (phases B, R, C; grid_topk.cu).
// Rows whose visible count is at most K take 0 .. visible-1 without a score read; a group none of whose rows sees
// more than K columns is not scored at all.
//
// One CTA shape for both halves: 128 threads (4 warps).  The scorer's warps each score 16 of a tile's 64 columns: it
// is built for exactly 4 warps.  The grid tail is a template on BLOCK that needs BLOCK to be a multiple of the warp
// and NB = 2048 bins a multiple of BLOCK (16 bins a thread in the last arriver's scan) and a thread per polled
// word (at most 4 rows x 31 lower CTAs <= 128): BLOCK = 128 serves it, so no warp idles in either phase.
//
// Time model (estimates; nothing is measured yet).  Keys: the call reads each visible key once per row group, 256 B a
// column in bf16, so the floor is sum over groups of (visible keys of the group x 256 B) / HBM bandwidth (H100 SXM
// about 3.35 TB/s; e.g. 64 decode rows over 32K columns: 537 MB, 160 us), a CTA's share its chunk's keys at 1/132 of
// the bandwidth (split 2: 16K columns, 4 MB a CTA); the MMAs are a tenth of that (native_scorer.cu).  What the
// composite path adds and this saves: the logits' write and read (4 B a row and column: 3% of the key bytes for one
// row a group, 12% for four) and one launch.
// Selection: the grid select's tail after the scoring, once for the group: the histograms over the CTA's chunk in
// shared memory (c / 128 keys a thread and row), 1 to 3 rounds shared by the group's rows (a round: an L2 round trip
// for the one arrival, the last arriver's read of every undecided row's 2048 bins at once and a block scan a row, the
// release and the waiters' poll and payload read: about 2.5-3 us, plus ~0.3 us a further row), one tagged counts
// exchange (~1 us) and the ordered output per row: about 10 us for a decode row and, estimated, about 12-15 us for a
// verify group of 4 rows (was about 40 us with a row's rounds one after another), whatever the context (flat in its
// length while the chunk stays small; estimates, nothing measured).  So
// the fused path wins where the keys' time is short against a launch and the logits round trip (decode and draft of
// modest contexts) and needs measuring elsewhere: it is ranked after the composite path until tuned rows say so.
// Quantised caches read fewer key bytes (fp8 132 B, MXFP4 68 B a column with the scales: native_scorer.cu's time
// model), so the keys' floor above falls by about 2x and 4x against the same selection tail.
// Shared memory: the scorer's stages (64 KB + flags; a quantised stage holds its keys and their scales within a
// 16-bit stage's bytes, so one plan serves every format; the tail's 4 x 8 KB histograms reuse them), the tail's
// scan and res words (1.25 KB), and group_rows x cap x 4 B of scores: the co-resident grid limits cap (at most 32768
// keys, 10304 for 4 rows on 227 KB) and so the context a call serves.
//
// Workspace: the grid select's slots (GRID_SLOT_WORDS words a slot: a histogram a row, arrival counter, flag, payload
// words, per CTA and row words),
// zeroed once and left clean by every launch (a CUDA graph replays it with new lengths), and out (rows x K int32).
//
// Kernels (extern "C"; fused_select.py beside this file declares them): qsa_fused_<bf16|fp16>_page<16|64> (16-bit
// caches), qsa_fused_fp8_<bf16|fp16>_page<16|64> and qsa_fused_fp4_bf16_page<16|64> (the scorer's names).  With
// -DQSA_FUSED_SINGLE -DQSA_FUSED_KERNEL_<name> only <name> is built.  The scorer's and the grid select's own kernels
// are compiled out (QSA_NATIVE_SINGLE, TOPK_SINGLE with no kernel named).

#ifndef QSA_NATIVE_SINGLE
#define QSA_NATIVE_SINGLE 1
#endif
#ifndef TOPK_SINGLE
#define TOPK_SINGLE 1
#endif
#include "native_scorer.cu"
#include "grid_topk.cu"

#define QSA_FUSED_THREADS QSA_THREADS
#define QSA_FUSED_CTAS_PER_SM 2
// Dynamic shared memory (bytes): the scorer's (stages | flags | rows) | the grid tail's scan and res words | the
// scores' stash.  The tail's per-row histograms (GRID_MAX_ROWS x 2048 words) live in the tile stages, free once a
// group is scored, so they cost the stash nothing.
#define QSA_FUSED_GRID_OFFSET QSA_SHARED_BYTES
#define QSA_FUSED_STASH_OFFSET (QSA_FUSED_GRID_OFFSET + GRID_TAIL_WORDS * 4)

static_assert(QSA_SHARED_BYTES % 16 == 0, "the grid's words and the stash start 16-byte aligned");
static_assert(GRID_BINS % QSA_FUSED_THREADS == 0 && QSA_FUSED_THREADS >= GRID_MAX_ROWS * GRID_MAX_SPLIT,
              "the grid tail's scan and polls fit the scorer's CTA");
static_assert(QSA_MAX_GROUP_ROWS <= GRID_MAX_ROWS, "a row group goes through the tail's rounds together");
static_assert(QSA_MAX_GROUP_ROWS * GRID_BINS * 4 <= QSA_FLAGS_OFFSET,
              "the tail's histograms fit the tile stages, below the page flags and the group's rows");
static_assert(QuantKeys<QSA_KIND_FP8>::SCALES + 4 * QSA_TILE <= QSA_TILE_BYTES &&
                  QuantKeys<QSA_KIND_FP4>::SCALES + 4 * QSA_TILE <= QSA_TILE_BYTES,
              "a quantised stage (keys and their scales) fits a 16-bit stage: one shared-memory plan for every format");

// Phase A's source: the row's fp32 scores are already in `keys` (the scorer's epilogue wrote them there); turn them
// into order-preserving keys in place and histogram their top 11 bits.
struct FusedKeys {
    template <int BLOCK>
    __device__ __forceinline__ void tile_keys(int, int, int len, unsigned* keys, unsigned* H) const {
        for (int i = threadIdx.x; i < len; i += BLOCK) {
            const unsigned k = grid_key(__uint_as_float(keys[i]));
            keys[i] = k;
            atomicAdd(&H[k >> 21], 1u);
        }
    }
};

// The group's visible counts for the grid tail (s_vis, read by thread r for row r).
struct FusedCounts {
    const int* vis;
    __device__ __forceinline__ int operator()(int r) const { return vis[r]; }
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

// Kernel parameters: the pointers, then the scalars (fused_select.py declares them once, PARAMS; every scalar a C
// int).  out: the block indices [rows, K] (a workspace); tokens: the expansion [rows, tok_ld apart]; scores: the
// debug scores or null; stamps: the debug timer records or null (QSA_STAMP_COUNT words a CTA and group the CTA's
// slot takes: CTA b's i-th group at (b * ceil(row_groups / slots) + i) * QSA_STAMP_COUNT; native_compat.h's
// qsa_stamp); workspace: the slots' words.  k_scale: the quantised caches' per-key scales (4 bytes a key,
// where the scorer takes them: after keys; unread for 16-bit caches).  wide: native_scorer.cu's QSA_WIDE_* bits.
#define QSA_FUSED_PARAMS                                                                                          \
    const unsigned short *__restrict__ q, const unsigned short *__restrict__ keys,                                 \
        const void *__restrict__ k_scale, const void *__restrict__ page_table,                                     \
        const void *__restrict__ token_to_request, const void *__restrict__ query_positions,                       \
        const void *__restrict__ context_lens, int *__restrict__ out,                                              \
        int *__restrict__ tokens, float *__restrict__ scores, unsigned long long *__restrict__ stamps,             \
        unsigned *workspace, int num_tokens,                                                                       \
        int num_requests, int num_pages, int num_columns, int table_width, int table_stride, int page_stride,      \
        int slot_stride, int group_rows, int row_groups, int split, int slots, int cap, int K, int ratio,          \
        int scale_bits, int wide, int aligned, int width, int tok_ld, int scores_ld
#define QSA_FUSED_ARGS                                                                                            \
    q, keys, k_scale, page_table, token_to_request, query_positions, context_lens, out, tokens, scores, stamps,    \
        workspace,                                                                                                 \
        num_tokens, num_requests, num_pages, num_columns, table_width, table_stride, page_stride, slot_stride,     \
        group_rows, row_groups, split, slots, cap, K, ratio, scale_bits, wide, aligned, width, tok_ld, scores_ld

template <int PAGE, bool F16, int KIND>
__device__ __forceinline__ void fused_kernel(QSA_FUSED_PARAMS) {
    TOPK_DYNAMIC_SMEM(smem);
    unsigned char* tiles = reinterpret_cast<unsigned char*>(smem);
    unsigned char* flags = tiles + QSA_FLAGS_OFFSET;
    int* s_req = reinterpret_cast<int*>(tiles + QSA_ROWS_OFFSET);
    int* s_vis = s_req + QSA_MAX_GROUP_ROWS;
    unsigned* hist = reinterpret_cast<unsigned*>(tiles);  // the tail's histograms, once a group is scored
    unsigned* tail = reinterpret_cast<unsigned*>(tiles + QSA_FUSED_GRID_OFFSET);
    unsigned* stash = reinterpret_cast<unsigned*>(tiles + QSA_FUSED_STASH_OFFSET);
    wait_for_prior_grid();
    const int part = blockIdx.x % split, slot = blockIdx.x / split;
    unsigned* ws = workspace + (long long)slot * GRID_SLOT_WORDS;
    constexpr int GEN_WORD = GRID_RES_WORD - GRID_SCAN_WORD + 5;
    if (threadIdx.x == 0)
        tail[GEN_WORD] =
            (unsigned)(grid_load_acquire(reinterpret_cast<const unsigned long long*>(ws + GRID_FLAG_WORD)) >> 32);
    __syncthreads();
    unsigned gen = tail[GEN_WORD];
    __syncthreads();
    const float scale = score_scale<F16, KIND>(scale_bits);  // the scorer's: fp8 keys in fp16 times 2**8
    // grid_tokens' index widths: positions 1, contexts 2, requests 4.
    const int idx_wide = ((wide & QSA_WIDE_POSITIONS) ? 1 : 0) | ((wide & QSA_WIDE_CONTEXTS) ? 2 : 0) |
                         ((wide & QSA_WIDE_REQUESTS) ? 4 : 0);
    const KeySource src = {keys, page_table, (wide & QSA_WIDE_PAGES) != 0, table_width, num_pages, page_stride,
                           slot_stride, aligned != 0, static_cast<const unsigned char*>(k_scale)};
    const FusedKeys source = {};
    const GridExpand x = {query_positions, context_lens, token_to_request, tokens, num_requests, ratio, tok_ld,
                          idx_wide};
    const int slot_groups = (row_groups + slots - 1) / slots;  // the stamps' records a CTA
    for (int group = slot; group < row_groups; group += slots) {
        const long long first_row = (long long)group * group_rows;
        const long long record = (long long)blockIdx.x * slot_groups + (group - slot) / slots;
        unsigned long long* const rec = stamps == nullptr ? nullptr : stamps + record * QSA_STAMP_COUNT;
        qsa_stamp(rec, QSA_STAMP_START);
        unsigned a[QSA_K_STEPS][4];
        load_query_fragments_of<KIND>(q, first_row, group_rows, num_tokens, a);
        if (threadIdx.x < QSA_MAX_GROUP_ROWS) {
            int req = -1, vis = 0;
            if ((int)threadIdx.x < group_rows)
                row_visibility(token_to_request, query_positions, context_lens, first_row + threadIdx.x, num_tokens,
                               num_requests, num_columns, ratio, wide, req, vis);
            s_req[threadIdx.x] = req;
            s_vis[threadIdx.x] = vis;
        }
        __syncthreads();
        qsa_stamp(rec, QSA_STAMP_QUERY);
        int basis = 0;
        bool wide_row = false;
        for (int i = 0; i < group_rows; ++i) {
            basis = s_vis[i] > basis ? s_vis[i] : basis;
            wide_row |= s_vis[i] > K;
        }
        const int chunk = ((basis + split - 1) / split + GRID_TILE - 1) / GRID_TILE * GRID_TILE;
        if (wide_row) {  // CTA-uniform
            fused_score<PAGE, F16, KIND>(src, a, s_req, s_vis, group_rows, first_row, part * chunk, chunk, table_stride,
                                   scale, tiles, flags, stash, cap, scores, scores_ld);
            for (int i = threadIdx.x; i < group_rows * GRID_BINS; i += QSA_FUSED_THREADS) hist[i] = 0u;
            __syncthreads();
        }
        qsa_stamp(rec, QSA_STAMP_SCORE);
        const int rows = num_tokens - first_row < group_rows ? (int)(num_tokens - first_row) : group_rows;
        gen = grid_rows_keys<QSA_FUSED_THREADS>((int)first_row, rows, FusedCounts{s_vis}, basis, part, source, out,
                                                x, ws, K, split, width, gen, hist, tail, stash, cap, rec);
        __syncthreads();  // s_req, s_vis and the stash are free for the next group
        qsa_stamp(rec, QSA_STAMP_END);
    }
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
