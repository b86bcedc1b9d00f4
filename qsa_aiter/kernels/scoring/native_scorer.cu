// native_scorer.cu -- QSA index scoring on the tensor cores (mma.sync m16n8k16), for bf16, fp16, fp8 (e4m3fn, one fp32
// scale a key) and MXFP4 key caches.
//
// Contract (SPEC.md section 1; the op qsa_paged_mqa_logits): for query row t with request r = token_to_request[t]
// and position p = query_positions[t],
//   visible[t] = clamp(min((p + 1) / R, context_lens[r] / R), 0, num_columns)     (0 for r outside [0, requests))
//   logits[t, c] = (sum over the 4 heads h of max(0, q[t, h, :] . K[c, :])) * scale     for c < visible[t]
// with K[c] = keys[page_table[r, c / PAGE], c % PAGE] and scale = 1 / score_divisor (fp32 bits in scale_bits).  A
// column whose page id is outside [0, num_pages) (or past the table width) is never read and scores -inf.  Columns at
// or past visible[t] are not written.  Accumulation is fp32.
//
// Time model.  Decode, draft and verify read every visible key once per row group: 256 bytes per column in bf16, so
// the floor of a call is (sum over row groups of the visible keys' bytes + the logits written) / HBM bandwidth
// (H100 SXM about 3.35 TB/s: 9 requests x 4 rows over 128K tokens = 9 x 32768 keys x 256 B = 75.5 MB, 22.5 us).
// Quantised caches read fewer bytes a column: fp8 128 + 4 (its scale), MXFP4 64 + 4 (its 4 exponents), so the same
// call's floor is 38.9 MB, 11.6 us (fp8) and 20.1 MB, 6.0 us (MXFP4).  Their price is the decode, in registers, per
// element: fp8 to bf16 about 4 integer ops and one fp32 multiply (fp8 to fp16 2 integer ops: the scale's 2**8 is
// folded into the epilogue), MXFP4 about 4 integer ops and one fp32 multiply (two for exponents past 128); 64
// elements a lane a tile: about 300 (fp8) and 320 (MXFP4) instructions a warp a tile against 16 MMAs, 300 and 320
// cycles of an SM's 4 schedulers for a CTA's 4 warps (0.17 and 0.18 us at 1.75 GHz).  A tile of 64 keys arrives in
// about 0.33 us (fp8, 8.4 KB) or 0.17 us (MXFP4, 4.3 KB) at an SM's share of the bandwidth: fp8 stays under the HBM
// floor with room, MXFP4 about at it (estimates, not measured: the decode is the part to shave next, with byte
// permutes and packed 16-bit FMAs as the Triton scorers' PTX decoders do).
// The MMAs are few (M = 16: 64 m16n8k16 per 16 KB tile, about a tenth of the time the tile takes to arrive from
// HBM at an SM's share of the bandwidth), so the kernel is built to keep enough key bytes in flight: a 4-stage
// cp.async pipeline per CTA and 3 CTAs per SM (3 x 3 tiles of 16 KB ahead per SM, far above bandwidth x latency).
//
// Work split.  A CTA (4 warps, 128 threads) serves one row group -- group_rows (<= 16 / heads = 4) consecutive query
// rows, which the host sizes to one request's rows (verify: its next_n rows; decode, draft: one row) -- and one of
// `splits` contiguous ranges of the group's column tiles (the CTA index is group * splits + split; the host picks
// splits from the SM count so that the grid fills each SM about 3 times).  Every CTA of a group computes the rows'
// visible counts itself (split 0 writes them out) and cuts the group's tiles [0, ceil(visible / 64)) into `splits`
// equal ranges: balanced whatever the request's length.  A group whose rows belong to several requests (uneven verify
// rows, padding) is walked once per distinct request, storing only that request's rows.
//
// One column tile (score_tile): 64 keys x 128 dims of bf16 = 16 KB, staged by cp.async (16 bytes per thread-op, 8
// per thread) into one of 4 shared-memory stages.  The keys' page ids are read per 16 columns (page 16) or per tile
// (page 64); a bad page's keys are zero-filled (never read) and its columns flagged, the epilogue writes them -inf.
// The tile is stored key-major with 16-byte chunks xor-swizzled by the key's low 3 bits (chunk' = chunk ^ (key & 7)),
// so that ldmatrix's 8 row addresses (8 keys at one chunk) hit 8 different bank groups.  q of the group is the MMA's
// A operand, M = rows x heads ordered m = row * 4 + head (q's own memory order), zero past the group's rows, loaded
// once per CTA into registers (8 k-steps x 4 registers).  Each warp scores 16 columns: per k-step one ldmatrix.x4
// gives the B fragments of two n8 tiles, and two MMAs accumulate them.
//
// Epilogue (score_epilogue): ReLU per (row, head) element (a NaN stays NaN), the 4 heads summed by two xor shuffles
// (lanes 4 apart hold the same row's heads: ((h0 + h1) + (h2 + h3)) on every lane, bitwise the same), times scale,
// -inf for a bad page, stored for c < visible[row] only.  The seam for the fused top-k: for_each_request (the walk over
// a group's distinct requests) and score_tiles (the staged pipeline over tiles [begin, end) of one request, each
// scored tile handed to an epilogue functor in registers) serve this kernel and fused_select.cu's alike; the scorer's
// epilogue writes the scores to HBM, the fused one to a per-row area of shared memory that its selection histograms.
//
// Determinism.  A (row, column) score is computed by one instruction sequence whatever the other rows of the call
// and the split: the same MMAs over the same fixed k-steps (the MMA's result for one row does not depend on the other
// rows of A, which are zero or other rows), the same shuffles and multiply; so identical keys score identically, and
// a row scored alone (decode) equals the same row inside a verify group.
//
// Quantised caches (stage_tile, score_quant_tile, scale_columns): the loader stages the cache's own bytes with cp.async
// (half or a quarter of a 16-bit tile, plus 4 scale bytes a key by a 4-byte cp.async), so the pipeline moves what HBM
// holds and the loads stay 16 bytes wide.  Converting in shared memory after the stage would cost a second pass and a
// barrier a tile; instead each lane reads its own keys' bytes (16-byte ld.shared: fp8 keys' chunks swizzled by the
// key's low bit so the 8 lanes of a load phase hit 32 distinct banks; MXFP4 keys 64 bytes, two a 128-byte line,
// conflict-free as they are) and decodes them in registers into the MMA's B fragments, in a k order of its own that q's
// A fragments follow (load_query_fragments_quant): ldmatrix is not used.  Every element is decoded once a CTA.  fp8:
// e4m3fn to bf16 exactly (fp32 bit placement times 2**120, the top half), or to fp16 as the value times 2**-8 (bit
// placement, exact), a NaN byte to a 16-bit NaN; the per-key scale multiplies the head sum (the scale is positive, so
// sum_h ReLU(q_h . s k) = s sum_h ReLU(q_h . k): SPEC.md section 3), a NaN scale gives NaN.  MXFP4: each lane's 16
// bytes of a key are one 32-element MX block, so one exponent e a lane and key; e2m1 x 2**(e - 127) computed in fp32 as
// the dequantiser does (exact: 2 significant bits, fp32's and bf16's exponent range the same: e = 0 gives bf16
// subnormals, exact; e >= 254 overflows the largest codes to inf as the dequantised cache does; e = 255 is inf, so a
// zero code gives NaN), then bf16 (the top half); fp16 queries are not served (values past fp16's range).
//
// Portability: native_compat.h (vendor facts, launch bounds) and native_mma.h (cp.async, ldmatrix, mma, shuffles)
// are spliced in by native_scorer.py; the matrix primitives exist for NVIDIA compute capability 8.0+ only, so the
// spec offers no variant for AMD targets.  Build selection: every kernel by default; with -DQSA_NATIVE_SINGLE
// -DQSA_NATIVE_KERNEL_<name> only <name> (one program, one JIT-cache entry, per kernel).

#include "native_compat.h"
#include "native_mma.h"

#define QSA_HEADS 4
#define QSA_HEAD_DIM 128
#define QSA_MMA_M 16
#define QSA_MAX_GROUP_ROWS (QSA_MMA_M / QSA_HEADS)
#define QSA_TILE 64
#define QSA_STAGES 4
#define QSA_THREADS 128
#define QSA_CTAS_PER_SM 3
#define QSA_KEY_BYTES (QSA_HEAD_DIM * 2)
#define QSA_KEY_CHUNKS (QSA_KEY_BYTES / 16)
#define QSA_TILE_BYTES (QSA_TILE * QSA_KEY_BYTES)
#define QSA_K_STEPS (QSA_HEAD_DIM / 16)
#define QSA_COPIES (QSA_TILE * QSA_KEY_CHUNKS / QSA_THREADS)
// Dynamic shared memory: the stages' key tiles | each stage's per-column page flags | the group's request ids and
// visible counts (native_scorer.py's SHARED_BYTES mirrors it).
#define QSA_FLAGS_OFFSET (QSA_STAGES * QSA_TILE_BYTES)
#define QSA_ROWS_OFFSET (QSA_FLAGS_OFFSET + QSA_STAGES * QSA_TILE)
#define QSA_SHARED_BYTES (QSA_ROWS_OFFSET + 2 * QSA_MAX_GROUP_ROWS * 4)

static_assert(WS == 32, "native_scorer.cu: the mma.sync fragments are laid out over 32 lanes (NVIDIA warps)");
static_assert(QSA_THREADS / WS * 16 == QSA_TILE, "each warp scores 16 columns of a tile");
static_assert(QSA_TILE * QSA_KEY_CHUNKS % QSA_THREADS == 0 && QSA_THREADS % QSA_KEY_CHUNKS == 0,
              "a tile's 16-byte chunks split evenly over the threads, whole keys per thread row");

// The wide bits of the metadata tensors (the `wide` argument): 1 = int64, else int32.
#define QSA_WIDE_PAGES 1
#define QSA_WIDE_REQUESTS 2
#define QSA_WIDE_POSITIONS 4
#define QSA_WIDE_CONTEXTS 8
// Positions and context lengths are clamped to [-1, 2**40] / [0, 2**40] before the 64-bit arithmetic (no overflow of
// p + 1; no count changes, the host refuses columns that stand for 2**31 tokens or more).
#define QSA_METADATA_MAX (1ll << 40)

__device__ __forceinline__ long long load_index(const void* p, long long i, bool wide) {
    return wide ? static_cast<const long long*>(p)[i] : (long long)static_cast<const int*>(p)[i];
}

__device__ __forceinline__ long long clamp64(long long x, long long lo, long long hi) {
    return x < lo ? lo : (x > hi ? hi : x);
}

// The request id (-1: padded or out of range) and visible count of query row `row`.
__device__ __forceinline__ void row_visibility(const void* token_to_request, const void* query_positions,
                                               const void* context_lens, long long row, int num_tokens,
                                               int num_requests, int num_columns, int ratio, int wide, int& req,
                                               int& vis) {
    req = -1;
    vis = 0;
    if (row >= num_tokens) return;
    const long long r = load_index(token_to_request, row, wide & QSA_WIDE_REQUESTS);
    if (r < 0 || r >= num_requests) return;
    const long long p = clamp64(load_index(query_positions, row, wide & QSA_WIDE_POSITIONS), -1, QSA_METADATA_MAX);
    const long long c = clamp64(load_index(context_lens, r, wide & QSA_WIDE_CONTEXTS), 0, QSA_METADATA_MAX);
    const long long by_position = (p + 1) / ratio, by_context = c / ratio;
    req = (int)r;
    vis = (int)clamp64(by_position < by_context ? by_position : by_context, 0, num_columns);
}

// The group's request ids and visible counts into s_req[i] / s_vis[i] (written by threads 0 .. QSA_MAX_GROUP_ROWS - 1;
// rows past the group or the call: no request, nothing visible).  Returns the calling thread's row's visible count
// (threads below group_rows).  No barrier: the caller's makes them visible.
__device__ __forceinline__ int load_group_rows(const void* token_to_request, const void* query_positions,
                                               const void* context_lens, long long first_row, int group_rows,
                                               int num_tokens, int num_requests, int num_columns, int ratio, int wide,
                                               int* s_req, int* s_vis) {
    int req = -1, vis = 0;
    if (threadIdx.x < QSA_MAX_GROUP_ROWS) {
        if ((int)threadIdx.x < group_rows)
            row_visibility(token_to_request, query_positions, context_lens, first_row + threadIdx.x, num_tokens,
                           num_requests, num_columns, ratio, wide, req, vis);
        s_req[threadIdx.x] = req;
        s_vis[threadIdx.x] = vis;
    }
    return vis;
}

// q of the group as the MMA's A operand: M = rows x heads (m = row * 4 + head, q's memory order), K = head_dim;
// rows past the group or past num_tokens are zero.  16-bit loads: q needs no alignment beyond its element's.
__device__ __forceinline__ void load_query_fragments(const unsigned short* __restrict__ q, long long first_row,
                                                     int group_rows, int num_tokens,
                                                     unsigned (&a)[QSA_K_STEPS][4]) {
    const int lane = threadIdx.x % WS, g = lane >> 2, t = lane & 3;
    const int m_lo = g, m_hi = g + 8;
    const bool lo_ok = m_lo < group_rows * QSA_HEADS && first_row + m_lo / QSA_HEADS < num_tokens;
    const bool hi_ok = m_hi < group_rows * QSA_HEADS && first_row + m_hi / QSA_HEADS < num_tokens;
    const unsigned short* lo = q + (first_row * QSA_HEADS + m_lo) * QSA_HEAD_DIM + 2 * t;
    const unsigned short* hi = q + (first_row * QSA_HEADS + m_hi) * QSA_HEAD_DIM + 2 * t;
#pragma unroll
    for (int ks = 0; ks < QSA_K_STEPS; ++ks) {
        const int k = 16 * ks;
        a[ks][0] = lo_ok ? (unsigned)lo[k] | (unsigned)lo[k + 1] << 16 : 0u;
        a[ks][1] = hi_ok ? (unsigned)hi[k] | (unsigned)hi[k + 1] << 16 : 0u;
        a[ks][2] = lo_ok ? (unsigned)lo[k + 8] | (unsigned)lo[k + 9] << 16 : 0u;
        a[ks][3] = hi_ok ? (unsigned)hi[k + 8] | (unsigned)hi[k + 9] << 16 : 0u;
    }
}

// Where the tile loader reads a request's keys.
struct KeySource {
    const unsigned short* keys;
    const void* page_row;  // page_table's row of the request
    bool wide_pages;
    int table_width, num_pages, page_stride, slot_stride;  // strides in elements
    bool aligned;  // the cache's base and strides keep every key 16-byte aligned: cp.async; else 16-bit loads
    const unsigned char* scales;  // quantised caches: the per-key scales, 4 bytes a key at slot page * PAGE + offset
};

// Starts copying column tile `tile` (columns < req_visible only) into `stage`, and sets `flags[col]` to whether the
// column's page is good.  Key `n` of the tile is row n of the stage (256 bytes), its 16-byte chunk k at position
// k ^ (n & 7).  Thread x copies chunk x % 16 of keys x / 16 + 8 i (i < 8): its keys' pages are compile-time
// functions of i, each page id loaded once.  ALIGNED: cp.async (the cache keeps every key 16-byte aligned); else
// 16-bit loads and a shared-memory store (a cache view at an odd address or stride; correct, not fast).  The seam for
// quantised keys: a plain load, dequantised in registers, then a shared-memory store, where this issues a cp.async.
template <int PAGE, bool ALIGNED>
__device__ __forceinline__ void copy_tile(const KeySource& src, int tile, int req_visible, unsigned char* stage,
                                          unsigned char* flags) {
    static_assert(PAGE % 16 == 0, "pages of 16, 32, 48 ... columns: a thread's 8 keys span whole 16-column runs");
    constexpr int PAGES = PAGE < QSA_TILE ? QSA_TILE / PAGE : 1;
    constexpr int KEY_STEP = QSA_THREADS / QSA_KEY_CHUNKS;
    const int first = tile * QSA_TILE;
    long long ids[PAGES];
#pragma unroll
    for (int p = 0; p < PAGES; ++p) {
        const int col = first + p * PAGE;
        const int logical = col / PAGE;
        ids[p] = col < req_visible && logical < src.table_width
                     ? load_index(src.page_row, logical, src.wide_pages) : -1ll;
    }
    const int chunk = threadIdx.x % QSA_KEY_CHUNKS, key0 = threadIdx.x / QSA_KEY_CHUNKS;
#pragma unroll
    for (int i = 0; i < QSA_COPIES; ++i) {
        const int key = key0 + KEY_STEP * i;
        const int col = first + key;
        // the key's page among the tile's: (key0 + 8 i) / PAGE = 8 i / PAGE, as key0 < 8 and PAGE % 16 == 0
        const long long id = ids[PAGE < QSA_TILE ? KEY_STEP * i / PAGE : 0];
        const bool page_ok = id >= 0 && id < src.num_pages;
        const bool copy = page_ok && col < req_visible;
        const unsigned short* from =
            copy ? src.keys + id * src.page_stride + (long long)(col % PAGE) * src.slot_stride + 8 * chunk : src.keys;
        unsigned char* to = stage + key * QSA_KEY_BYTES + ((chunk ^ (key & 7)) << 4);
        if (ALIGNED) {
            cp_async_16(to, from, copy ? 16u : 0u);
        } else {
            unsigned w[4] = {0u, 0u, 0u, 0u};
            if (copy) {
#pragma unroll
                for (int e = 0; e < 4; ++e) w[e] = (unsigned)from[2 * e] | (unsigned)from[2 * e + 1] << 16;
            }
            *reinterpret_cast<uint4*>(to) = make_uint4(w[0], w[1], w[2], w[3]);
        }
        if (chunk == 0) flags[key] = page_ok;
    }
}
template <int PAGE>
__device__ __forceinline__ void issue_tile(const KeySource& src, int tile, int req_visible, unsigned char* stage,
                                           unsigned char* flags) {
    if (src.aligned)
        copy_tile<PAGE, true>(src, tile, req_visible, stage, flags);
    else
        copy_tile<PAGE, false>(src, tile, req_visible, stage, flags);
}

// ---------------------------------------------------------------------------------------------------------------
// Quantised keys (the KIND template argument): fp8 e4m3fn with one fp32 scale per key, MXFP4 (e2m1 nibbles, one e8m0
// exponent per 32 elements).  The tile loader stages the cache's own bytes (128 or 64 a key, plus 4 scale bytes a key)
// with cp.async, as it does 16-bit keys; each lane then reads its keys' bytes with 16-byte shared-memory loads and
// converts them in registers to the MMA's 16-bit type (no ldmatrix: the fragments are built where they are decoded).
// The MMA's k order is free as long as q follows it, so a lane's B fragment of a k-step is 4 consecutive bytes of one
// key (fp8) or 2 consecutive bytes (MXFP4), and q's A fragment is loaded in the same order
// (load_query_fragments_quant).
#define QSA_KIND_16BIT 0
#define QSA_KIND_FP8 1
#define QSA_KIND_FP4 2

template <int KIND>
struct QuantKeys {
    static constexpr int BYTES = KIND == QSA_KIND_FP8 ? QSA_HEAD_DIM : QSA_HEAD_DIM / 2;  // of a key, in the cache
    static constexpr int CHUNKS = BYTES / 16;
    static constexpr int KEY_STEP = QSA_THREADS / CHUNKS;  // keys apart, a thread's copies
    static constexpr int COPIES = QSA_TILE * CHUNKS / QSA_THREADS;
    static constexpr int SCALES = QSA_TILE * BYTES;  // offset of the keys' scales in a stage (4 bytes a key)
};
static_assert(QuantKeys<QSA_KIND_FP8>::SCALES + 4 * QSA_TILE <= QSA_TILE_BYTES, "a stage holds fp8 keys and scales");
static_assert(QuantKeys<QSA_KIND_FP4>::SCALES + 4 * QSA_TILE <= QSA_TILE_BYTES,
              "a stage holds MXFP4 keys and exponents");
static_assert(QSA_HEAD_DIM == 128, "the quantised fragments assume 128 dims: 8 k-steps, one MX block per lane");

// The page id of key `key` of a tile among the tile's page ids (selects, no indexed register array).
template <int PAGE, int PAGES>
__device__ __forceinline__ long long page_of_key(const long long (&ids)[PAGES], int key) {
    long long id = ids[0];
#pragma unroll
    for (int p = 1; p < PAGES; ++p)
        if (key >= p * PAGE) id = ids[p];
    return id;
}

// copy_tile for quantised keys: key n of the tile is row n of the stage (BYTES bytes), its 16-byte chunk k at position
// k ^ 4 (n & 1) for fp8 (the 8 lanes of a 16-byte-load phase read keys n, n + 1 (n even) at chunks 4 h + t, t < 4: the
// swizzle puts key n + 1's in the other half of the 128-byte line, so the 8 reads cover all 32 banks), at k for MXFP4
// (two 64-byte keys are one 128-byte line already); then the keys' 4 scale bytes at SCALES + 4 n (cp.async of 4 bytes,
// threads 0..63) and the page flags.  Unaligned caches: byte loads and a shared-memory store.
template <int PAGE, bool ALIGNED, int KIND>
__device__ __forceinline__ void copy_quant_tile(const KeySource& src, int tile, int req_visible, unsigned char* stage,
                                                unsigned char* flags) {
    using F = QuantKeys<KIND>;
    static_assert(PAGE % 16 == 0, "pages of 16, 32, 48 ... columns");
    constexpr int PAGES = PAGE < QSA_TILE ? QSA_TILE / PAGE : 1;
    const int first = tile * QSA_TILE;
    long long ids[PAGES];
#pragma unroll
    for (int p = 0; p < PAGES; ++p) {
        const int col = first + p * PAGE;
        const int logical = col / PAGE;
        ids[p] = col < req_visible && logical < src.table_width
                     ? load_index(src.page_row, logical, src.wide_pages) : -1ll;
    }
    const unsigned char* keys = reinterpret_cast<const unsigned char*>(src.keys);
    const int chunk = threadIdx.x % F::CHUNKS, key0 = threadIdx.x / F::CHUNKS;
#pragma unroll
    for (int i = 0; i < F::COPIES; ++i) {
        const int key = key0 + F::KEY_STEP * i;
        const int col = first + key;
        const long long id = page_of_key<PAGE, PAGES>(ids, key);
        const bool copy = id >= 0 && id < src.num_pages && col < req_visible;
        const unsigned char* from =
            copy ? keys + id * src.page_stride + (long long)(col % PAGE) * src.slot_stride + 16 * chunk : keys;
        const int position = KIND == QSA_KIND_FP8 ? chunk ^ ((key & 1) << 2) : chunk;
        unsigned char* to = stage + key * F::BYTES + (position << 4);
        if (ALIGNED) {
            cp_async_16(to, from, copy ? 16u : 0u);
        } else {
            unsigned w[4] = {0u, 0u, 0u, 0u};
            if (copy) {
#pragma unroll
                for (int e = 0; e < 16; ++e) w[e / 4] |= (unsigned)from[e] << (8 * (e % 4));
            }
            *reinterpret_cast<uint4*>(to) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
    if (threadIdx.x < QSA_TILE) {
        const int key = threadIdx.x, col = first + key;
        const long long id = page_of_key<PAGE, PAGES>(ids, key);
        const bool page_ok = id >= 0 && id < src.num_pages;
        const bool copy = page_ok && col < req_visible;
        const unsigned char* from = copy ? src.scales + 4 * (id * PAGE + col % PAGE) : src.scales;
        cp_async_4(stage + F::SCALES + 4 * key, from, copy ? 4u : 0u);
        flags[key] = page_ok;
    }
}

// Starts staging tile `tile` of keys of format KIND (issue_tile for 16-bit keys).
template <int PAGE, int KIND>
__device__ __forceinline__ void stage_tile(const KeySource& src, int tile, int req_visible, unsigned char* stage,
                                           unsigned char* flags) {
    if constexpr (KIND == QSA_KIND_16BIT) {
        issue_tile<PAGE>(src, tile, req_visible, stage, flags);
    } else if (src.aligned) {
        copy_quant_tile<PAGE, true, KIND>(src, tile, req_visible, stage, flags);
    } else {
        copy_quant_tile<PAGE, false, KIND>(src, tile, req_visible, stage, flags);
    }
}

// The k order of the quantised tiles: lane 4 g + t's elements of k-step ks are dims d, d + 1 (the fragment's 2t, 2t +
// 1) and d + 2, d + 3 (its 2t + 8, 2t + 9) with d = 64 (ks / 4) + 16 t + 4 (ks % 4) for fp8 (a lane reads 16 bytes of a
// key at 64 h + 16 t, for k-steps 4h .. 4h + 3) and d = 32 t + 4 ks for MXFP4 (a lane reads 16 bytes, 32 elements: the
// key's MX block t, so one exponent per lane and key).
template <int KIND>
__device__ __forceinline__ int quant_k_base(int t, int ks) {
    return KIND == QSA_KIND_FP8 ? 64 * (ks >> 2) + 16 * t + 4 * (ks & 3) : 32 * t + 4 * ks;
}

// load_query_fragments in the k order of the quantised tiles.
template <int KIND>
__device__ __forceinline__ void load_query_fragments_quant(const unsigned short* __restrict__ q, long long first_row,
                                                           int group_rows, int num_tokens,
                                                           unsigned (&a)[QSA_K_STEPS][4]) {
    const int lane = threadIdx.x % WS, g = lane >> 2, t = lane & 3;
    const int m_lo = g, m_hi = g + 8;
    const bool lo_ok = m_lo < group_rows * QSA_HEADS && first_row + m_lo / QSA_HEADS < num_tokens;
    const bool hi_ok = m_hi < group_rows * QSA_HEADS && first_row + m_hi / QSA_HEADS < num_tokens;
    const unsigned short* lo = q + (first_row * QSA_HEADS + m_lo) * QSA_HEAD_DIM;
    const unsigned short* hi = q + (first_row * QSA_HEADS + m_hi) * QSA_HEAD_DIM;
#pragma unroll
    for (int ks = 0; ks < QSA_K_STEPS; ++ks) {
        const int d = quant_k_base<KIND>(t, ks);
        a[ks][0] = lo_ok ? (unsigned)lo[d] | (unsigned)lo[d + 1] << 16 : 0u;
        a[ks][1] = hi_ok ? (unsigned)hi[d] | (unsigned)hi[d + 1] << 16 : 0u;
        a[ks][2] = lo_ok ? (unsigned)lo[d + 2] | (unsigned)lo[d + 3] << 16 : 0u;
        a[ks][3] = hi_ok ? (unsigned)hi[d + 2] | (unsigned)hi[d + 3] << 16 : 0u;
    }
}

// q of the group as the MMA's A operand in the k order of the keys of format KIND (load_query_fragments for 16-bit
// keys): the scorer's and fused_select.cu's kernels load it so.
template <int KIND>
__device__ __forceinline__ void load_query_fragments_of(const unsigned short* __restrict__ q, long long first_row,
                                                        int group_rows, int num_tokens,
                                                        unsigned (&a)[QSA_K_STEPS][4]) {
    if constexpr (KIND == QSA_KIND_16BIT)
        load_query_fragments(q, first_row, group_rows, num_tokens, a);
    else
        load_query_fragments_quant<KIND>(q, first_row, group_rows, num_tokens, a);
}

// The factor of the head sums (head_sums' scale): 1 / score_divisor (fp32 bits in scale_bits), times 2**8 for fp8
// keys decoded to fp16 (e4m3x16_to_pairs gives the values times 2**-8): exact.  The scorer's and fused_select.cu's.
template <bool F16, int KIND>
__device__ __forceinline__ float score_scale(int scale_bits) {
    return __uint_as_float((unsigned)scale_bits) * (KIND == QSA_KIND_FP8 && F16 ? 256.0f : 1.0f);
}

// An e4m3fn byte (bits 0..7 of x) as fp32, exactly: its 7 magnitude bits placed under fp32's exponent field are the
// value times 2**-120 (subnormals included), times 2**120.
__device__ __forceinline__ float e4m3_value(unsigned x) {
    return __uint_as_float(((x & 0x7Fu) << 20) | ((x & 0x80u) << 24)) * __uint_as_float(0x7B800000u);
}

// 16 e4m3fn bytes as 8 registers of 16-bit pairs (b[2s] = bytes 4s, 4s + 1; b[2s + 1] = bytes 4s + 2, 4s + 3).
// bf16 (F16 false): each value exactly (fp32, then its top half: 4 significant bits).  fp16: the bytes placed under
// fp16's exponent field, which is the value times 2**-8 exactly (subnormals included); the caller multiplies the
// scores by 2**8.  A NaN byte (0x7F, 0xFF: e4m3fn's only NaN) becomes a 16-bit NaN (checked four bytes at a time: a
// byte whose low 7 bits are all ones carries into its top bit).
template <bool F16>
__device__ __forceinline__ void e4m3x16_to_pairs(const uint4& v, unsigned (&b)[8]) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
    unsigned nan = 0u;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const unsigned x = w[s] >> (16 * p);
            b[2 * s + p] = F16 ? ((x & 0x7Fu) << 7) | ((x & 0x80u) << 8) | ((x & 0x7F00u) << 15) |
                                     ((x & 0x8000u) << 16)
                               : (__float_as_uint(e4m3_value(x)) >> 16) |
                                     (__float_as_uint(e4m3_value(x >> 8)) & 0xFFFF0000u);
        }
        nan |= ((w[s] & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
    }
    if (nan) {
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const unsigned bytes = ((w[s] & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                const unsigned x = bytes >> (16 * p);
                b[2 * s + p] |= (x & 0x80u ? 0x7FFFu : 0u) | (x & 0x8000u ? 0x7FFF0000u : 0u);
            }
        }
    }
}

// An e2m1 code (bits 0..3 of x) placed under fp32's exponent field: the value times 2**-126 (0.5 gives the subnormal
// 2**-127; exact).
__device__ __forceinline__ float e2m1_times_2_126(unsigned x) {
    return __uint_as_float(((x & 7u) << 22) | ((x & 8u) << 28));
}

// 16 bytes of MXFP4 (32 elements of one MX block, element 2i the low nibble of byte i) with the block's e8m0 exponent
// `e` as 16 registers of bf16 pairs (b[i] = elements 2i, 2i + 1): each element e2m1 x 2**(e - 127) in fp32, then the
// top half.  Exact, as the dequantiser computes it: e2m1 values have 2 significant bits and bf16 has fp32's exponent
// range.  e <= 128 (every usual block): e2m1_times_2_126 x 2**(e - 1), one multiply; larger e: x 2**126 x 2**(e - 127),
// where e >= 254 overflows the largest codes to inf and e = 255 (e8m0's NaN) is inf: a zero code gives NaN, others
// inf, as in the dequantised cache.  e = 0: 2**-127 x 0.5 and 2**-127 are bf16 subnormals, exact.
__device__ __forceinline__ void mxfp4x32_to_bf16_pairs(const uint4& v, unsigned e, unsigned (&b)[16]) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
    if (e <= 128u) {
        const float factor = __uint_as_float((e + 126u) << 23);  // 2**(e - 1)
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const unsigned x = w[i / 4] >> (8 * (i % 4));
            b[i] = (__float_as_uint(e2m1_times_2_126(x) * factor) >> 16) |
                   (__float_as_uint(e2m1_times_2_126(x >> 4) * factor) & 0xFFFF0000u);
        }
    } else {
        const float up = __uint_as_float(0x7E800000u), factor = __uint_as_float(e << 23);  // 2**126, 2**(e - 127)
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const unsigned x = w[i / 4] >> (8 * (i % 4));
            b[i] = (__float_as_uint(e2m1_times_2_126(x) * up * factor) >> 16) |
                   (__float_as_uint(e2m1_times_2_126(x >> 4) * up * factor) & 0xFFFF0000u);
        }
    }
}

// score_tile for quantised keys: lane 4 g + t decodes its bytes of key 8 n + g of its warp's 16 (16-byte shared-memory
// loads: fp8 two a key, at 64 h + 16 t; MXFP4 one, at 16 t, and the key's exponent t) into B fragments, and the MMAs
// accumulate them against q in the same k order.  MXFP4 keys need a bf16 MMA (F16 false).
template <bool F16, int KIND>
__device__ __forceinline__ void score_quant_tile(const unsigned char* stage, const unsigned (&a)[QSA_K_STEPS][4],
                                                 float (&acc)[2][4]) {
    using F = QuantKeys<KIND>;
    static_assert(KIND == QSA_KIND_FP8 || !F16, "MXFP4 keys are dequantised to bf16");
    const int lane = threadIdx.x % WS, warp = threadIdx.x / WS;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
        const int key = warp * 16 + n * 8 + g;
        const unsigned char* row = stage + key * F::BYTES;
        if constexpr (KIND == QSA_KIND_FP8) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                unsigned b[8];
                e4m3x16_to_pairs<F16>(*reinterpret_cast<const uint4*>(row + (((4 * h + t) ^ ((key & 1) << 2)) << 4)),
                                      b);
#pragma unroll
                for (int s = 0; s < 4; ++s) mma_16816<F16>(acc[n], a[4 * h + s], b[2 * s], b[2 * s + 1]);
            }
        } else {
            unsigned b[16];
            mxfp4x32_to_bf16_pairs(*reinterpret_cast<const uint4*>(row + (t << 4)), stage[F::SCALES + 4 * key + t], b);
#pragma unroll
            for (int ks = 0; ks < QSA_K_STEPS; ++ks) mma_16816<false>(acc[n], a[ks], b[2 * ks], b[2 * ks + 1]);
        }
    }
}

// fp8: the head sums times each column's scale (staged with its key): lane 4 g + t holds columns 8 n + 2 t and
// 8 n + 2 t + 1 of its warp's 16 (acc[n][0], acc[n][2] and acc[n][1], acc[n][3]).  A NaN scale gives a NaN score.
__device__ __forceinline__ void scale_columns(float (&acc)[2][4], const unsigned char* stage_scales) {
    const int lane = threadIdx.x % WS, warp = threadIdx.x / WS, t = lane & 3;
    const float* scales = reinterpret_cast<const float*>(stage_scales) + warp * 16 + 2 * t;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
        const float s0 = scales[8 * n], s1 = scales[8 * n + 1];
        acc[n][0] *= s0;
        acc[n][1] *= s1;
        acc[n][2] *= s0;
        acc[n][3] *= s1;
    }
}

// The dot products of the group's 16 rows x heads with this warp's 16 columns of a staged tile: acc[n8 tile][C
// fragment], zeroed first.  Lane l gives the address of row l % 8 of matrix l / 8: keys 16 w + 8 (j / 2) + l % 8 at
// chunk 2 ks + j % 2, so r[0], r[1] are the B fragment of columns 0..7 of the warp and r[2], r[3] of columns 8..15.
template <bool F16>
__device__ __forceinline__ void score_tile(const unsigned char* stage, const unsigned (&a)[QSA_K_STEPS][4],
                                           float (&acc)[2][4]) {
    const int lane = threadIdx.x % WS, warp = threadIdx.x / WS;
    const int j = lane >> 3, r = lane & 7;
    const unsigned char* row = stage + (warp * 16 + (j >> 1) * 8 + r) * QSA_KEY_BYTES;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < QSA_K_STEPS; ++ks) {
        unsigned b[4];
        ldmatrix_x4(b, row + (((2 * ks + (j & 1)) ^ r) << 4));
        mma_16816<F16>(acc[0], a[ks], b[0], b[1]);
        mma_16816<F16>(acc[1], a[ks], b[2], b[3]);
    }
}

// ReLU per (row, head) (a NaN stays NaN), the heads summed, times scale: afterwards the 4 lanes holding one row's
// heads (lanes 4 apart) hold the row's score, bitwise the same.
__device__ __forceinline__ void head_sums(float (&acc)[2][4], float scale) {
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float x = acc[n][e] <= 0.0f ? 0.0f : acc[n][e];
            x += shfl_xor_f32(x, 4);
            x += shfl_xor_f32(x, 8);
            acc[n][e] = x * scale;
        }
}

// The scorer's epilogue: each lane stores two adjacent columns of one row (lane 4 g + t: the row (g / 4) + 2 (g % 4
// & 1), the n8 tile (g % 4) / 2, columns 2t and 2t + 1 of it), -inf where the page is bad, for c < visible[row] of
// the rows of the request in hand (`mine`).
__device__ __forceinline__ void store_scores(const float (&s)[2][4], float* __restrict__ logits, int logits_stride,
                                             long long first_row, int group_rows, unsigned mine, const int* vis,
                                             const unsigned char* flags, int tile) {
    const int lane = threadIdx.x % WS, warp = threadIdx.x / WS;
    const int g = lane >> 2, t = lane & 3, head = g & 3;
    const int n8 = head >> 1, upper = head & 1;
    const int row = (g >> 2) + 2 * upper;
    if (row >= group_rows || !((mine >> row) & 1u)) return;
    const float v0 = n8 ? (upper ? s[1][2] : s[1][0]) : (upper ? s[0][2] : s[0][0]);
    const float v1 = n8 ? (upper ? s[1][3] : s[1][1]) : (upper ? s[0][3] : s[0][1]);
    const int in_tile = warp * 16 + n8 * 8 + 2 * t;
    const int col = tile * QSA_TILE + in_tile;
    const int limit = vis[row];
    const float neg_inf = __uint_as_float(0xFF800000u);
    float* out = logits + (first_row + row) * (long long)logits_stride + col;
    if (col < limit) out[0] = flags[in_tile] ? v0 : neg_inf;
    if (col + 1 < limit) out[1] = flags[in_tile + 1] ? v1 : neg_inf;
}

// Calls visit(req, mine, req_visible) once per distinct request of the group (at its first row that sees anything),
// in row order: req the request id, mine the bit mask of the group's rows of that request that see anything,
// req_visible the widest of their visible counts.  Rows with no request or nothing visible are skipped.
template <typename Visit>
__device__ __forceinline__ void for_each_request(const int* s_req, const int* s_vis, int group_rows, Visit&& visit) {
    for (int i = 0; i < group_rows; ++i) {
        const int req = s_req[i];
        if (req < 0 || s_vis[i] <= 0) continue;
        bool seen = false;
        unsigned mine = 0;
        int req_visible = 0;
        for (int j = 0; j < group_rows; ++j) {
            if (s_req[j] != req || s_vis[j] <= 0) continue;
            seen |= j < i;
            mine |= 1u << j;
            req_visible = s_vis[j] > req_visible ? s_vis[j] : req_visible;
        }
        if (seen) continue;
        visit(req, mine, req_visible);
    }
}

// page_table's row of request `req` (rows table_stride entries apart, int64 entries where wide_pages).
__device__ __forceinline__ const void* request_page_row(const unsigned char* table, int req, int table_stride,
                                                        bool wide_pages) {
    return table + (long long)req * table_stride * (wide_pages ? 8 : 4);
}

// The staged tile pipeline over tiles [begin, end) of one request (nothing where begin >= end): QSA_STAGES - 1 tiles
// staged ahead (stage_tile), then per tile the wait, a barrier, the next tile's staging into the stage freed, the
// MMAs (score_tile, or score_quant_tile for quantised keys), head_sums and, for fp8, the keys' scales
// (scale_columns); epilogue(acc, tile_flags, tile) then receives the tile's scores in registers with the stage's page
// flags.  Ends with every copy landed and a barrier: the stages are free for the next request's copies.
template <int PAGE, bool F16, int KIND, typename Epilogue>
__device__ __forceinline__ void score_tiles(const KeySource& src, const unsigned (&a)[QSA_K_STEPS][4], float scale,
                                            int begin, int end, int req_visible, unsigned char* tiles,
                                            unsigned char* flags, Epilogue&& epilogue) {
    if (begin >= end) return;
#pragma unroll 1
    for (int s = 0; s < QSA_STAGES - 1; ++s) {
        if (begin + s < end)
            stage_tile<PAGE, KIND>(src, begin + s, req_visible, tiles + s * QSA_TILE_BYTES, flags + s * QSA_TILE);
        cp_async_commit();
    }
    for (int tile = begin; tile < end; ++tile) {
        cp_async_wait<QSA_STAGES - 2>();
        __syncthreads();  // the tile is in every thread's view; every warp is done with the stage refilled next
        const int next = tile + QSA_STAGES - 1;
        if (next < end) {
            const int s = (next - begin) % QSA_STAGES;
            stage_tile<PAGE, KIND>(src, next, req_visible, tiles + s * QSA_TILE_BYTES, flags + s * QSA_TILE);
        }
        cp_async_commit();
        const int s = (tile - begin) % QSA_STAGES;
        float acc[2][4];
        if constexpr (KIND == QSA_KIND_16BIT)
            score_tile<F16>(tiles + s * QSA_TILE_BYTES, a, acc);
        else
            score_quant_tile<F16, KIND>(tiles + s * QSA_TILE_BYTES, a, acc);
        head_sums(acc, scale);
        if constexpr (KIND == QSA_KIND_FP8)
            scale_columns(acc, tiles + s * QSA_TILE_BYTES + QuantKeys<QSA_KIND_FP8>::SCALES);
        epilogue(acc, flags + s * QSA_TILE, tile);
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the stages before the next request's copies
}

// Kernel parameters: the pointers, then the scalars (native_scorer.py declares them once, PARAMS; every scalar is a
// C int).  wide: the QSA_WIDE_* bits of the int64 metadata tensors; aligned: the cache's keys are 16-byte
// aligned (cp.async); scale_bits: the fp32 bits of 1 / score_divisor.
#define QSA_SCORER_PARAMS                                                                                          \
    const unsigned short *__restrict__ q, const unsigned short *__restrict__ keys,                                 \
        const void *__restrict__ k_scale, const void *__restrict__ page_table,                                     \
        const void *__restrict__ token_to_request, const void *__restrict__ query_positions,                       \
        const void *__restrict__ context_lens, float *__restrict__ logits, int *__restrict__ visible,              \
        int num_tokens, int num_requests, int num_pages, int num_columns, int table_width, int table_stride,       \
        int logits_stride, int page_stride, int slot_stride, int group_rows, int splits, int ratio,               \
        int scale_bits, int wide, int aligned
#define QSA_SCORER_ARGS                                                                                           \
    q, keys, k_scale, page_table, token_to_request, query_positions, context_lens, logits, visible, num_tokens,    \
        num_requests, num_pages, num_columns, table_width, table_stride, logits_stride, page_stride, slot_stride, \
        group_rows, splits, ratio, scale_bits, wide, aligned

template <int PAGE, bool F16, int KIND = QSA_KIND_16BIT>
__device__ __forceinline__ void score_kernel(QSA_SCORER_PARAMS) {
    TOPK_DYNAMIC_SMEM(smem);
    unsigned char* tiles = reinterpret_cast<unsigned char*>(smem);
    unsigned char* flags = tiles + QSA_FLAGS_OFFSET;
    int* s_req = reinterpret_cast<int*>(tiles + QSA_ROWS_OFFSET);
    int* s_vis = s_req + QSA_MAX_GROUP_ROWS;
    wait_for_prior_grid();
    const int group = blockIdx.x / splits, split = blockIdx.x % splits;
    const long long first_row = (long long)group * group_rows;
    // q first: its loads depend on nothing, so they overlap the metadata's chain (request id, then context length).
    unsigned a[QSA_K_STEPS][4];
    load_query_fragments_of<KIND>(q, first_row, group_rows, num_tokens, a);
    const int vis = load_group_rows(token_to_request, query_positions, context_lens, first_row, group_rows, num_tokens,
                                    num_requests, num_columns, ratio, wide, s_req, s_vis);
    if (split == 0 && (int)threadIdx.x < group_rows && first_row + threadIdx.x < num_tokens)
        visible[first_row + threadIdx.x] = vis;
    __syncthreads();
    const float scale = score_scale<F16, KIND>(scale_bits);  // fp8 keys in fp16: times 2**8 here
    KeySource src = {keys, page_table, (wide & QSA_WIDE_PAGES) != 0, table_width, num_pages, page_stride,
                     slot_stride, aligned != 0, static_cast<const unsigned char*>(k_scale)};
    const unsigned char* table = static_cast<const unsigned char*>(page_table);
    for_each_request(s_req, s_vis, group_rows, [&](int req, unsigned mine, int req_visible) {
        src.page_row = request_page_row(table, req, table_stride, src.wide_pages);
        // This CTA's tiles: range `split` of `splits` equal ranges of the request's tiles.
        const int tiles_total = (req_visible + QSA_TILE - 1) / QSA_TILE;
        const int per_split = (tiles_total + splits - 1) / splits;
        const int begin = split * per_split;
        const int end = begin + per_split < tiles_total ? begin + per_split : tiles_total;
        score_tiles<PAGE, F16, KIND>(src, a, scale, begin, end, req_visible, tiles, flags,
                                     [&](const float (&acc)[2][4], const unsigned char* tile_flags, int tile) {
                                         store_scores(acc, logits, logits_stride, first_row, group_rows, mine, s_vis,
                                                      tile_flags, tile);
                                     });
    });
}

#define QSA_SCORER_KERNEL(name, PAGE, F16)                                                                         \
    extern "C" __global__ void TOPK_LAUNCH_BOUNDS(QSA_THREADS, QSA_CTAS_PER_SM) name(QSA_SCORER_PARAMS) {       \
        score_kernel<PAGE, F16>(QSA_SCORER_ARGS);                                                                 \
    }
// The quantised caches' kernels: KIND QSA_KIND_FP8 or QSA_KIND_FP4, F16 the query's (and the MMA's) type.
#define QSA_QUANT_SCORER_KERNEL(name, PAGE, F16, KIND)                                                             \
    extern "C" __global__ void TOPK_LAUNCH_BOUNDS(QSA_THREADS, QSA_CTAS_PER_SM) name(QSA_SCORER_PARAMS) {       \
        score_kernel<PAGE, F16, KIND>(QSA_SCORER_ARGS);                                                           \
    }

#if !defined(QSA_NATIVE_SINGLE) || defined(QSA_NATIVE_KERNEL_qsa_score_bf16_page16)
QSA_SCORER_KERNEL(qsa_score_bf16_page16, 16, false)
#endif
#if !defined(QSA_NATIVE_SINGLE) || defined(QSA_NATIVE_KERNEL_qsa_score_bf16_page64)
QSA_SCORER_KERNEL(qsa_score_bf16_page64, 64, false)
#endif
#if !defined(QSA_NATIVE_SINGLE) || defined(QSA_NATIVE_KERNEL_qsa_score_fp16_page16)
QSA_SCORER_KERNEL(qsa_score_fp16_page16, 16, true)
#endif
#if !defined(QSA_NATIVE_SINGLE) || defined(QSA_NATIVE_KERNEL_qsa_score_fp16_page64)
QSA_SCORER_KERNEL(qsa_score_fp16_page64, 64, true)
#endif
#if !defined(QSA_NATIVE_SINGLE) || defined(QSA_NATIVE_KERNEL_qsa_score_fp8_bf16_page16)
QSA_QUANT_SCORER_KERNEL(qsa_score_fp8_bf16_page16, 16, false, QSA_KIND_FP8)
#endif
#if !defined(QSA_NATIVE_SINGLE) || defined(QSA_NATIVE_KERNEL_qsa_score_fp8_bf16_page64)
QSA_QUANT_SCORER_KERNEL(qsa_score_fp8_bf16_page64, 64, false, QSA_KIND_FP8)
#endif
#if !defined(QSA_NATIVE_SINGLE) || defined(QSA_NATIVE_KERNEL_qsa_score_fp8_fp16_page16)
QSA_QUANT_SCORER_KERNEL(qsa_score_fp8_fp16_page16, 16, true, QSA_KIND_FP8)
#endif
#if !defined(QSA_NATIVE_SINGLE) || defined(QSA_NATIVE_KERNEL_qsa_score_fp8_fp16_page64)
QSA_QUANT_SCORER_KERNEL(qsa_score_fp8_fp16_page64, 64, true, QSA_KIND_FP8)
#endif
#if !defined(QSA_NATIVE_SINGLE) || defined(QSA_NATIVE_KERNEL_qsa_score_fp4_bf16_page16)
QSA_QUANT_SCORER_KERNEL(qsa_score_fp4_bf16_page16, 16, false, QSA_KIND_FP4)
#endif
#if !defined(QSA_NATIVE_SINGLE) || defined(QSA_NATIVE_KERNEL_qsa_score_fp4_bf16_page64)
QSA_QUANT_SCORER_KERNEL(qsa_score_fp4_bf16_page64, 64, false, QSA_KIND_FP4)
#endif
