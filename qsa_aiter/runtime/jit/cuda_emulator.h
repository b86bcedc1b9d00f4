// cuda_emulator.h -- runs the native kernels' CUDA C++ (the top-k, the scorer) on the CPU, for tests on machines
// without a GPU.
//
// g++ compiles a native source (native_topk.cu, native_scorer.cu) with -DTOPK_EMULATE and this header force-included
// (runtime/jit/emulated.py). Every CUDA thread of a launch becomes a cooperative thread of one OS thread (its own
// stack, entered once through a ucontext, then switched with _setjmp/_longjmp, which save no signal mask); a thread
// runs until it must wait (__syncthreads, a warp collective, a cluster barrier, an unfinished mbarrier), then the next
// one runs. The CTAs of a thread-block cluster run together, so their barriers and distributed shared memory
// (mapa + red.shared::cluster) behave as on sm_90; clusters (or CTAs) run one after another. Bulk copies complete
// when issued. Atomics are plain read-modify-writes: one thread runs at a time. The scorer's matrix primitives
// (native_mma.h) are warp collectives here too: ldmatrix reads the rows its lanes address, mma.sync m16n8k16 gathers
// the lanes' fragments as the PTX ISA lays them out and computes each D element in fp32 (the 16 products, exact for
// bf16 and fp16 inputs, added in k order, then added to C: one fixed order, whatever the other rows and columns);
// a cp.async copies (or zero-fills) when issued, so its commit and wait do nothing.
//
// What it checks is the kernels' logic: barriers, warp collectives, cluster exchanges, shared-memory layouts and
// the results. It does not model timing or memory-ordering races between warps (every interleaving it runs is
// sequentially consistent), and it is slow (a launch of a few thousand threads takes milliseconds).
//
// The warp width is the build's (-DTOPK_WARP_SIZE, 32 or 64): 32 emulates an NVIDIA target (CUDA's shuffles and
// votes with 32-bit lane masks, thread-block clusters and bulk copies), 64 an AMD wave64 one as HIP defines it (its
// shuffles and votes take no mask, its ballot is 64 bits; no clusters, no bulk copies): TOPK_EMULATED_HIP and
// TOPK_EMULATED_WARP_SIZE tell native_compat.h which target it is.
//
// The source's side of the contract: under TOPK_EMULATE it declares dynamic shared memory with
// TOPK_DYNAMIC_SMEM(name) and leaves out its inline-assembly primitives; this header defines them.
#pragma once
#ifndef TOPK_WARP_SIZE
#error "cuda_emulator.h: the emulated build names its warp width (-DTOPK_WARP_SIZE=32 or 64)"
#endif
#if TOPK_WARP_SIZE != 32 && TOPK_WARP_SIZE != 64
#error "cuda_emulator.h: the emulated warp width is 32 (an NVIDIA target) or 64 (an AMD wave64 target)"
#endif
#define TOPK_EMULATED_WARP_SIZE TOPK_WARP_SIZE
#define TOPK_EMULATED_HIP (TOPK_WARP_SIZE == 64)
#include <math.h>
#include <setjmp.h>
#include <stdint.h>
#include <string.h>
#include <ucontext.h>

#include <stdexcept>
#include <string>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __cluster_dims__(...)
#define __align__(n) alignas(n)

struct dim3 {
    unsigned x = 0, y = 0, z = 0;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) int4 {
    int x, y, z, w;
};
static_assert(sizeof(uint4) == 16, "uint4 is four words");
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }

inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
template <class T>
inline T __ldg(const T* p) { return *p; }
template <class T>
inline T __ldcg(const T* p) { return *p; }
inline void __threadfence() {}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
    const unsigned old = *p;
    *p = old + v;
    return old;
}
inline unsigned atomicMax(unsigned* p, unsigned v) {
    const unsigned old = *p;
    *p = old > v ? old : v;
    return old;
}
inline unsigned atomicOr(unsigned* p, unsigned v) {
    const unsigned old = *p;
    *p = old | v;
    return old;
}

namespace emu {

constexpr int kWarp = TOPK_EMULATED_WARP_SIZE;
constexpr size_t kStackBytes = 64 * 1024;

struct Cta;
struct Thread {
    ucontext_t context;  // the first entry
    jmp_buf resume;      // where a thread that gave up its turn goes on
    bool started = false;
    Cta* cta = nullptr;
    dim3 thread_idx, block_idx;
    bool done = false;
    unsigned barrier_phase = 0;  // the CTA barrier generation this thread waits to see pass
    unsigned warp_phase = 0;
    unsigned cluster_phase = 0;  // the cluster barrier generation it arrived at (barrier.cluster.arrive)
    const unsigned* wait_on = nullptr;  // a waiting thread is not resumed while *wait_on == wait_value
    unsigned wait_value = 0;
};

struct Warp {
    int live = 0, arrived = 0, op = -1;
    unsigned generation = 0;
    unsigned values[kWarp] = {};
    unsigned long long results[kWarp] = {};  // a ballot's lane mask is as wide as the warp
    int arg = 0;
    uint64_t operands[kWarp][10] = {};  // a matrix collective's operands per lane (an address, or MMA fragments)
    unsigned outputs[kWarp][4] = {};    // and its results per lane
};

struct Cluster;
struct Cta {
    std::vector<uint4> smem;  // dynamic shared memory, 16-byte aligned
    size_t smem_bytes = 0;
    unsigned rank = 0;  // in its cluster
    Cluster* cluster = nullptr;
    int live = 0, arrived = 0;
    unsigned generation = 0;
    std::vector<Warp> warps;
};

struct Cluster {
    std::vector<Cta> ctas;
    int live = 0, arrived = 0;
    unsigned generation = 0;
};

struct Scheduler {
    jmp_buf main;  // the scheduler's loop, where a thread that gives up its turn (or ends) jumps
    Thread* current = nullptr;
    std::string error;
    unsigned long long progress = 0;  // arrivals, copies and exits: a round without any is a deadlock
};
inline Scheduler& scheduler() {
    static thread_local Scheduler s;
    return s;
}
inline Thread& current() { return *scheduler().current; }
inline void fail(const std::string& what) { throw std::runtime_error(what); }
// Give the other threads a turn; the scheduler resumes this one in a later round.
inline void yield() {
    Thread& t = current();
    if (_setjmp(t.resume) == 0) _longjmp(scheduler().main, 1);
}
// Wait until *counter (a barrier's generation) moves past `value`; the scheduler skips this thread until then.
inline void wait_while(const unsigned* counter, unsigned value) {
    Thread& t = current();
    while (*counter == value) {
        t.wait_on = counter;
        t.wait_value = value;
        yield();
    }
    t.wait_on = nullptr;
}

inline unsigned* dynamic_smem() { return reinterpret_cast<unsigned*>(current().cta->smem.data()); }

// __syncthreads: every live thread of the CTA arrives; the last one opens the barrier. Every thread leaves it in the
// scheduler's order, so a read that a missing barrier leaves unordered sees what the order gives.
inline void syncthreads() {
    Thread& t = current();
    Cta& c = *t.cta;
    const unsigned gen = c.generation;
    ++scheduler().progress;
    if (++c.arrived == c.live) {  // the last to arrive opens the barrier, and lets the others run first
        c.arrived = 0;
        ++c.generation;
        yield();
        return;
    }
    wait_while(&c.generation, gen);
}

enum WarpOp { kShflIdx, kShflUp, kShflXor, kAll, kAny, kBallot, kLdmatrix, kMma };
// A warp collective: every live lane of the warp brings a value; the last to arrive computes all lanes' results.
inline unsigned long long warp_collective(WarpOp op, unsigned value, int arg) {
    Thread& t = current();
    Warp& w = t.cta->warps[t.thread_idx.x / kWarp];
    const int lane = t.thread_idx.x % kWarp;
    if (w.arrived == 0) {
        w.op = op;
        w.arg = arg;
    } else if (w.op != op || w.arg != arg) {
        fail("warp collective with lanes in different calls (a divergent __*_sync)");
    }
    w.values[lane] = value;
    const unsigned gen = w.generation;
    ++scheduler().progress;
    if (++w.arrived == w.live) {
        if (w.live != kWarp) fail("a warp collective with exited lanes");
        unsigned all = 1, any = 0;
        unsigned long long ballot = 0;
        for (int l = 0; l < kWarp; ++l) {
            all &= w.values[l] != 0;
            any |= w.values[l] != 0;
            ballot |= (unsigned long long)(w.values[l] != 0) << l;
        }
        for (int l = 0; l < kWarp; ++l) {
            switch (op) {
                case kShflIdx: w.results[l] = w.values[arg & (kWarp - 1)]; break;
                case kShflUp: w.results[l] = l >= arg ? w.values[l - arg] : w.values[l]; break;
                case kShflXor: w.results[l] = w.values[(l ^ arg) & (kWarp - 1)]; break;
                case kAll: w.results[l] = all; break;
                case kAny: w.results[l] = any; break;
                case kBallot: w.results[l] = ballot; break;
                default: fail("a matrix operation through a plain warp collective");
            }
        }
        w.arrived = 0;
        ++w.generation;
    } else {
        wait_while(&w.generation, gen);
    }
    return w.results[lane];
}

// barrier.cluster: arrive counts this thread into the current generation; wait blocks until it has passed.
inline void cluster_arrive() {
    Thread& t = current();
    Cluster& cl = *t.cta->cluster;
    t.cluster_phase = cl.generation;
    ++scheduler().progress;
    if (++cl.arrived == cl.live) {
        cl.arrived = 0;
        ++cl.generation;
    }
}
inline void cluster_wait() {
    Thread& t = current();
    wait_while(&t.cta->cluster->generation, t.cluster_phase);
}

// Shared-memory addresses: a CTA-relative byte offset; mapa puts (rank + 1) in the top byte.
inline unsigned smem_offset(const void* p) {
    const Cta& c = *current().cta;
    const char* base = reinterpret_cast<const char*>(c.smem.data());
    const ptrdiff_t off = reinterpret_cast<const char*>(p) - base;
    if (off < 0 || (size_t)off >= c.smem_bytes) fail("a shared-memory address outside the CTA's dynamic shared memory");
    return (unsigned)off;
}
inline unsigned* cluster_word(unsigned address) {
    Cluster& cl = *current().cta->cluster;
    const unsigned tag = address >> 24;
    if (tag == 0 || tag > cl.ctas.size()) fail("a shared::cluster address that mapa did not make");
    Cta& c = cl.ctas[tag - 1];
    const unsigned off = address & 0xFFFFFFu;
    if (off + 4 > c.smem_bytes || off % 4) fail("a remote shared-memory address outside the target CTA");
    return reinterpret_cast<unsigned*>(reinterpret_cast<char*>(c.smem.data()) + off);
}

// The 16-bit elements of the MMA's inputs.
inline float bf16_value(unsigned bits) { return __uint_as_float((bits & 0xFFFFu) << 16); }
inline float fp16_value(unsigned bits) {
    const unsigned exponent = (bits >> 10) & 0x1Fu, mantissa = bits & 0x3FFu;
    float v;
    if (exponent == 0)
        v = ldexpf((float)mantissa, -24);
    else if (exponent == 31)
        v = mantissa ? NAN : INFINITY;
    else
        v = ldexpf((float)(mantissa | 0x400u), (int)exponent - 25);
    return (bits & 0x8000u) ? -v : v;
}

// ldmatrix .x<matrices>: lane l receives, of each matrix j, the word (l % 4) of the row lane 8 j + l / 4 addresses.
inline void ldmatrix_all(Warp& w, int matrices) {
    for (int l = 0; l < kWarp; ++l)
        for (int j = 0; j < matrices; ++j) {
            const char* row = reinterpret_cast<const char*>((uintptr_t)w.operands[8 * j + l / 4][0]);
            if (smem_offset(row) % 16) fail("an ldmatrix row address that is not 16-byte aligned");
            smem_offset(row + 15);
            memcpy(&w.outputs[l][j], row + 4 * (l % 4), 4);
        }
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: each lane brings a[4], b[2], c[4] (operands 0-3, 4-5, 6-9) in
// the PTX fragment layout (native_mma.h); D[m][n] = C[m][n] + (sum over k in order of A[m][k] B[k][n]) in fp32.
inline void mma_all(Warp& w, bool f16) {
    if (kWarp != 32) fail("mma.sync m16n8k16 is a 32-lane instruction");
    float A[16][16], B[16][8], C[16][8];
    auto element = [f16](uint64_t reg, int half) {
        const unsigned bits = (unsigned)(reg >> (16 * half));
        return f16 ? fp16_value(bits) : bf16_value(bits);
    };
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, t = l % 4;
        const uint64_t* in = w.operands[l];
        for (int h = 0; h < 2; ++h) {
            A[g][2 * t + h] = element(in[0], h);
            A[g + 8][2 * t + h] = element(in[1], h);
            A[g][2 * t + 8 + h] = element(in[2], h);
            A[g + 8][2 * t + 8 + h] = element(in[3], h);
            B[2 * t + h][g] = element(in[4], h);
            B[2 * t + 8 + h][g] = element(in[5], h);
            C[g][2 * t + h] = __uint_as_float((unsigned)in[6 + h]);
            C[g + 8][2 * t + h] = __uint_as_float((unsigned)in[8 + h]);
        }
    }
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, t = l % 4;
        for (int i = 0; i < 4; ++i) {
            const int m = g + 8 * (i / 2), n = 2 * t + i % 2;
            float sum = 0.0f;
            for (int k = 0; k < 16; ++k) sum += A[m][k] * B[k][n];
            w.outputs[l][i] = __float_as_uint(C[m][n] + sum);
        }
    }
}

// A matrix collective: every lane of the warp brings its `operands`; the last to arrive computes every lane's
// `outputs` (op kLdmatrix with arg = matrices, kMma with arg = 1 for f16 inputs).
inline void matrix_collective(WarpOp op, int arg, const uint64_t* operands, int count, unsigned* outputs,
                              int results) {
    Thread& t = current();
    Warp& w = t.cta->warps[t.thread_idx.x / kWarp];
    const int lane = t.thread_idx.x % kWarp;
    if (w.arrived == 0) {
        w.op = op;
        w.arg = arg;
    } else if (w.op != op || w.arg != arg) {
        fail("warp collective with lanes in different calls (a divergent ldmatrix / mma.sync)");
    }
    memcpy(w.operands[lane], operands, sizeof(uint64_t) * count);
    const unsigned gen = w.generation;
    ++scheduler().progress;
    if (++w.arrived == w.live) {
        if (w.live != kWarp) fail("a warp collective with exited lanes");
        if (op == kLdmatrix)
            ldmatrix_all(w, arg);
        else
            mma_all(w, arg != 0);
        w.arrived = 0;
        ++w.generation;
    } else {
        wait_while(&w.generation, gen);
    }
    memcpy(outputs, w.outputs[lane], sizeof(unsigned) * results);
}

}  // namespace emu

#define threadIdx (emu::current().thread_idx)
#define blockIdx (emu::current().block_idx)
#define gridDim (emu::launch().grid_dim)  // emu::launch() is declared below, before any kernel uses it
#define TOPK_DYNAMIC_SMEM(name) unsigned* name = emu::dynamic_smem()

inline void __syncthreads() { emu::syncthreads(); }
// Each vendor's warp collectives, over the whole warp (the emulator fails a collective some lane does not reach): only
// the emulated target's, so a source that calls the other vendor's does not build.
#if TOPK_EMULATED_HIP
// HIP (wave64): no lane mask; __shfl's source lane is taken modulo the width, __shfl_up keeps a lane's own value
// below the delta, __ballot is a 64-bit mask.
inline int __all(int p) { return (int)emu::warp_collective(emu::kAll, p ? 1u : 0u, 0); }
inline int __any(int p) { return (int)emu::warp_collective(emu::kAny, p ? 1u : 0u, 0); }
inline unsigned long long __ballot(int p) { return emu::warp_collective(emu::kBallot, p ? 1u : 0u, 0); }
inline unsigned __shfl(unsigned v, int src) { return (unsigned)emu::warp_collective(emu::kShflIdx, v, src); }
inline unsigned __shfl_up(unsigned v, unsigned d) { return (unsigned)emu::warp_collective(emu::kShflUp, v, (int)d); }
inline unsigned __shfl_xor(unsigned v, int m) { return (unsigned)emu::warp_collective(emu::kShflXor, v, m); }
inline float __shfl_xor(float v, int m) { return __uint_as_float(__shfl_xor(__float_as_uint(v), m)); }
#else
// CUDA: a 32-bit mask of the lanes taking part (the kernels pass every lane's).
inline int __all_sync(unsigned, bool p) { return (int)emu::warp_collective(emu::kAll, p ? 1u : 0u, 0); }
inline int __any_sync(unsigned, bool p) { return (int)emu::warp_collective(emu::kAny, p ? 1u : 0u, 0); }
inline unsigned __ballot_sync(unsigned, bool p) { return (unsigned)emu::warp_collective(emu::kBallot, p ? 1u : 0u, 0); }
inline unsigned __shfl_sync(unsigned, unsigned v, int src) {
    return (unsigned)emu::warp_collective(emu::kShflIdx, v, src);
}
inline unsigned __shfl_up_sync(unsigned, unsigned v, int d) { return (unsigned)emu::warp_collective(emu::kShflUp, v, d); }
inline unsigned __shfl_xor_sync(unsigned, unsigned v, int m) {
    return (unsigned)emu::warp_collective(emu::kShflXor, v, m);
}
inline float __shfl_xor_sync(unsigned mask, float v, int m) {
    return __uint_as_float(__shfl_xor_sync(mask, __float_as_uint(v), m));
}
#endif

// The primitives the source writes in inline assembly on sm_90. An mbarrier lives in its 8 bytes of shared memory
// as a state word (initialised, expecting bytes, complete), so code that overwrites a live one is caught.
namespace emu {
constexpr uint64_t kMbarInit = 0x4D42415249u, kMbarExpect = 0x4D42415258u, kMbarDone = 0x4D42415244u;
inline uint64_t* mbarrier(unsigned bar) {
    Cta& c = *current().cta;
    if (bar % 8 || bar + 8 > c.smem_bytes) fail("an mbarrier address outside the CTA's shared memory");
    return reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(c.smem.data()) + bar);
}
}  // namespace emu
inline unsigned smem_u32(const void* p) { return emu::smem_offset(p); }
inline void mbar_init(unsigned bar, unsigned) { *emu::mbarrier(bar) = emu::kMbarInit; }
inline void mbar_fence_init() {}
inline void mbar_expect_tx(unsigned bar, unsigned) {
    if (*emu::mbarrier(bar) != emu::kMbarInit) emu::fail("expect_tx on an mbarrier that is not initialised");
    *emu::mbarrier(bar) = emu::kMbarExpect;
}
inline void bulk_g2s(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    emu::Cta& c = *emu::current().cta;
    if (dst + bytes > c.smem_bytes || dst % 16 || bytes % 16 || reinterpret_cast<uintptr_t>(src) % 16)
        emu::fail("a bulk copy outside the CTA's shared memory or not 16-byte aligned");
    if (*emu::mbarrier(bar) != emu::kMbarExpect) emu::fail("a bulk copy on an mbarrier that expects no bytes");
    if (dst < bar + 8 && bar < dst + bytes) emu::fail("a bulk copy over its own mbarrier");
    memcpy(reinterpret_cast<char*>(c.smem.data()) + dst, src, bytes);
    *emu::mbarrier(bar) = emu::kMbarDone;
    ++emu::scheduler().progress;
}
inline void mbar_wait0(unsigned bar) {
    for (;;) {
        const uint64_t state = *emu::mbarrier(bar);
        if (state == emu::kMbarDone) return;
        if (state != emu::kMbarInit && state != emu::kMbarExpect)
            emu::fail("a wait on an mbarrier that is not initialised (or was overwritten)");
        emu::yield();
    }
}
inline unsigned cluster_rank() { return emu::current().cta->rank; }
inline void cluster_arrive() { emu::cluster_arrive(); }
inline void cluster_wait() { emu::cluster_wait(); }
inline void cluster_sync() {
    emu::cluster_arrive();
    emu::cluster_wait();
}
inline unsigned mapa_u32(unsigned a, unsigned r) {
    if (r >= emu::current().cta->cluster->ctas.size()) emu::fail("mapa to a rank outside the cluster");
    return ((r + 1) << 24) | (a & 0xFFFFFFu);
}
inline void red_add_cluster(unsigned a, unsigned v) { *emu::cluster_word(a) += v; }
inline unsigned atom_add_cluster(unsigned a, unsigned v) {
    unsigned* w = emu::cluster_word(a);
    const unsigned old = *w;
    *w = old + v;
    return old;
}
inline void st_cluster_u32(unsigned a, unsigned x) { *emu::cluster_word(a) = x; }
inline unsigned ld_cluster_u32(unsigned a) { return *emu::cluster_word(a); }
inline void st_cluster_v2(unsigned a, unsigned x, unsigned y) {
    if (a % 8) emu::fail("a two-word remote store that is not 8-byte aligned");
    *emu::cluster_word(a) = x;
    *emu::cluster_word(a + 4) = y;
}

// The scorer's matrix primitives (native_mma.h), which the source writes in inline assembly.
inline void cp_async_16(void* dst, const void* src, unsigned src_bytes) {
    if (emu::smem_offset(dst) % 16) emu::fail("a cp.async to shared memory that is not 16-byte aligned");
    emu::smem_offset(static_cast<char*>(dst) + 15);
    if (src_bytes > 16) emu::fail("a cp.async of more than 16 bytes");
    if (src_bytes && reinterpret_cast<uintptr_t>(src) % 16)
        emu::fail("a cp.async from a global address that is not 16-byte aligned");
    memset(dst, 0, 16);
    if (src_bytes) memcpy(dst, src, src_bytes);
}
inline void cp_async_4(void* dst, const void* src, unsigned src_bytes) {
    if (emu::smem_offset(dst) % 4) emu::fail("a 4-byte cp.async to shared memory that is not 4-byte aligned");
    emu::smem_offset(static_cast<char*>(dst) + 3);
    if (src_bytes > 4) emu::fail("a 4-byte cp.async of more than 4 bytes");
    if (src_bytes && reinterpret_cast<uintptr_t>(src) % 4)
        emu::fail("a 4-byte cp.async from a global address that is not 4-byte aligned");
    memset(dst, 0, 4);
    if (src_bytes) memcpy(dst, src, src_bytes);
}
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}
inline void ldmatrix_x4(unsigned (&r)[4], const void* row) {
    const uint64_t address = (uint64_t)reinterpret_cast<uintptr_t>(row);
    emu::matrix_collective(emu::kLdmatrix, 4, &address, 1, r, 4);
}
template <bool F16>
inline void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    const uint64_t operands[10] = {a[0], a[1], a[2], a[3], b0, b1, __float_as_uint(d[0]), __float_as_uint(d[1]),
                                   __float_as_uint(d[2]), __float_as_uint(d[3])};
    unsigned out[4];
    emu::matrix_collective(emu::kMma, F16 ? 1 : 0, operands, 10, out, 4);
    for (int i = 0; i < 4; ++i) d[i] = __uint_as_float(out[i]);
}

namespace emu {

// Threads of the running cluster, and the body each runs (the kernel call).
struct Launch {
    std::vector<Thread> threads;
    std::vector<char*> stacks;  // one per thread, reused by the next cluster (never zeroed: pages are touched lazily)
    Cluster cluster;
    void (*body)(void*) = nullptr;
    void* body_arg = nullptr;
    dim3 grid_dim;
    ~Launch() {
        for (char* stack : stacks) delete[] stack;
    }
};
inline Launch& launch() {
    static thread_local Launch l;
    return l;
}

// A finished thread leaves its CTA's, warp's and cluster's counts; a barrier that only waited for it opens.
inline void retire(Thread& t) {
    Cta& c = *t.cta;
    Warp& w = c.warps[t.thread_idx.x / kWarp];
    Cluster& cl = *c.cluster;
    t.done = true;
    ++scheduler().progress;
    if (w.arrived > 0) fail("a thread exited while its warp waited in a collective");
    --w.live;
    if (--c.live > 0 && c.arrived == c.live) {
        c.arrived = 0;
        ++c.generation;
    }
    if (--cl.live > 0 && cl.arrived == cl.live) {
        cl.arrived = 0;
        ++cl.generation;
    }
}

inline void thread_entry(int index) {
    Thread& t = launch().threads[index];
    try {
        launch().body(launch().body_arg);
        retire(t);
    } catch (const std::exception& e) {
        if (scheduler().error.empty())
            scheduler().error = std::string(e.what()) + " (thread " + std::to_string(t.thread_idx.x) + " of CTA " +
                                std::to_string(t.block_idx.x) + ")";
        t.done = true;
    }
    _longjmp(scheduler().main, 1);  // never returns: this stack is left for good
}

// Runs `body` as every thread of a grid of `grid` CTAs of `block` threads, `cluster` CTAs a cluster, with
// `smem_bytes` of dynamic shared memory whose 32-bit word i holds i before the launch writes it: never-written shared
// memory reads as small plausible integers (a count, a column, a group), as a previous CTA's leftovers do on a GPU.
// `order_seed` 0 resumes the waiting threads in thread order; another value shuffles the order every round. Returns
// an empty string, or what went wrong (a deadlock, a bad address, a divergent collective).
inline std::string run(int grid, int block, int cluster, size_t smem_bytes, void (*body)(void*), void* arg,
                       unsigned order_seed) {
    Scheduler& sched = scheduler();
    sched.error.clear();
    if (block % kWarp || block <= 0 || cluster <= 0 || grid % cluster) return "bad launch shape";
    Launch& l = launch();
    l.body = body;
    l.grid_dim = dim3();
    l.grid_dim.x = grid;
    l.body_arg = arg;
    unsigned rng = order_seed * 2654435761u + 12345u;
    for (int c0 = 0; c0 < grid && sched.error.empty(); c0 += cluster) {
        l.cluster = Cluster();
        l.cluster.ctas.resize(cluster);
        l.cluster.live = cluster * block;
        for (int r = 0; r < cluster; ++r) {
            Cta& c = l.cluster.ctas[r];
            c.smem.resize((smem_bytes + 15) / 16 + 1);
            for (size_t i = 0; i < c.smem.size(); ++i) {
                const unsigned w = (unsigned)(4 * i);
                c.smem[i] = uint4{w, w + 1, w + 2, w + 3};
            }
            c.smem_bytes = smem_bytes;
            c.rank = r;
            c.cluster = &l.cluster;
            c.live = block;
            c.warps.assign(block / kWarp, Warp());
            for (Warp& w : c.warps) w.live = kWarp;
        }
        l.threads.clear();
        l.threads.resize((size_t)cluster * block);
        while (l.stacks.size() < l.threads.size()) l.stacks.push_back(new char[kStackBytes]);
        for (int r = 0; r < cluster; ++r)
            for (int x = 0; x < block; ++x) {
                Thread& t = l.threads[(size_t)r * block + x];
                t.cta = &l.cluster.ctas[r];
                t.thread_idx.x = x;
                t.block_idx.x = c0 + r;
                getcontext(&t.context);
                t.context.uc_stack.ss_sp = l.stacks[(size_t)r * block + x];
                t.context.uc_stack.ss_size = kStackBytes;
                t.context.uc_link = nullptr;  // thread_entry never returns
                makecontext(&t.context, reinterpret_cast<void (*)()>(thread_entry), 1, (int)((size_t)r * block + x));
            }
        std::vector<int> order(l.threads.size());
        for (size_t i = 0; i < order.size(); ++i) order[i] = (int)i;
        for (;;) {
            const unsigned long long before = sched.progress;
            if (order_seed)
                for (size_t i = order.size(); i > 1; --i) {
                    rng = rng * 1664525u + 1013904223u;
                    const size_t j = (rng >> 8) % i;
                    const int tmp = order[i - 1];
                    order[i - 1] = order[j];
                    order[j] = tmp;
                }
            bool running = false;
            for (int i : order) {
                Thread& t = l.threads[i];
                if (t.done) continue;
                running = true;
                if (t.wait_on != nullptr && *t.wait_on == t.wait_value) continue;
                sched.current = &t;
                if (_setjmp(sched.main) == 0) {
                    if (t.started) {
                        _longjmp(t.resume, 1);
                    } else {
                        t.started = true;
                        ucontext_t here;
                        swapcontext(&here, &t.context);  // the thread jumps back to sched.main, never here
                    }
                }
                sched.current = nullptr;
                if (!sched.error.empty()) break;
            }
            if (!running || !sched.error.empty()) break;
            if (sched.progress == before) {
                sched.error = "deadlock: every thread waits and no barrier can open";
                break;
            }
        }
    }
    l.threads.clear();
    return sched.error;
}

}  // namespace emu
