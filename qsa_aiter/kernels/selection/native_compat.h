// native_compat.h -- the vendor facts the native kernels meet, in one place: which vendor compiles them (CUDA
// through NVRTC, HIP through hipRTC or clang, or the CPU emulator), the target's warp width, warp shuffles and votes,
// launch bounds, and whether thread-block clusters and bulk copies exist.  native_topk.cu includes it and never
// tests the vendor itself.  native_topk.source() splices this file in where the source includes it, so NVRTC and
// hipRTC compile one text (no include path) and the JIT key's source hash covers both files.
#ifndef QSA_NATIVE_COMPAT_H
#define QSA_NATIVE_COMPAT_H

// TOPK_EMULATE: the CPU build of runtime/jit/cuda_emulator.h (tests without a GPU), which defines the inline-assembly
// primitives, the dynamic shared memory and the target it emulates (TOPK_EMULATED_HIP, TOPK_EMULATED_WARP_SIZE).
#ifndef TOPK_EMULATE
#define TOPK_EMULATE 0
#define TOPK_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned name[]
#endif

#if TOPK_EMULATE
#define TOPK_HIP TOPK_EMULATED_HIP
#elif defined(__HIPCC_RTC__) || defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
#define TOPK_HIP 1
#else
#define TOPK_HIP 0
#endif

// ---------------------------------------------------------------------------------------
// The warp width: the target's own (TOPK_TARGET_WARP_SIZE, from the compiler's target macros), checked against the
// width the build passes (-DTOPK_WARP_SIZE: 32 for sm_*, 64 for gfx942 / gfx950), never a default.  A build that
// passes none takes the target's.
#if TOPK_EMULATE
#define TOPK_TARGET_WARP_SIZE TOPK_EMULATED_WARP_SIZE
#elif TOPK_HIP && !defined(__HIP_DEVICE_COMPILE__)
// A HIP host pass compiles no device code and has no target: the width the build passes stands.
#ifndef TOPK_WARP_SIZE
#error "native_compat.h: a HIP host pass needs -DTOPK_WARP_SIZE (the device target's wavefront size)"
#endif
#define TOPK_TARGET_WARP_SIZE TOPK_WARP_SIZE
#elif TOPK_HIP
#if defined(__GFX9__)  // GCN and CDNA (gfx90a, gfx942 = MI300X/MI325X, gfx950 = MI355X): wave64 only
#define TOPK_TARGET_WARP_SIZE 64
#elif defined(__AMDGCN_WAVEFRONT_SIZE__)  // compilers that still state it (clang 22 does not)
#define TOPK_TARGET_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE__
#elif defined(__AMDGCN_WAVEFRONT_SIZE)
#define TOPK_TARGET_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#else
#error "native_compat.h: cannot tell this AMD target's wavefront size (the kernels are built for gfx9 targets)"
#endif
#else
#define TOPK_TARGET_WARP_SIZE 32  // every NVIDIA target
#endif
#ifndef TOPK_WARP_SIZE
#define TOPK_WARP_SIZE TOPK_TARGET_WARP_SIZE
#endif
static_assert(TOPK_WARP_SIZE == TOPK_TARGET_WARP_SIZE,
              "TOPK_WARP_SIZE (the width the build passes) is not the target's warp width: 32 for NVIDIA sm_*, 64 "
              "for AMD gfx9 (gfx942, gfx950)");
#define WS TOPK_WARP_SIZE

// ---------------------------------------------------------------------------------------
// Thread-block clusters (distributed shared memory, mapa, red.shared::cluster) and bulk copies (cp.async.bulk with
// mbarriers) exist on CUDA from sm_90 only.  On HIP they are compiled out: a build that asks for them, or for a
// cluster kernel by name, stops here (the launcher says "clusters compiled out on ROCm").
#if TOPK_HIP
#if defined(TOPK_CLUSTERS) && TOPK_CLUSTERS
#error "TOPK_CLUSTERS=1: thread-block clusters do not exist on HIP"
#endif
#if defined(TOPK_BULK) && TOPK_BULK
#error "TOPK_BULK=1: bulk copies (cp.async.bulk) do not exist on HIP"
#endif
#endif
#ifndef TOPK_CLUSTERS
#if !TOPK_HIP && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define TOPK_CLUSTERS 1
#else
#define TOPK_CLUSTERS 0
#endif
#endif
#ifndef TOPK_BULK
#if !TOPK_HIP && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define TOPK_BULK 1
#else
#define TOPK_BULK 0
#endif
#endif

// Shared-memory addresses and thread-block clusters (sm_90+; the emulator defines its own): a generic pointer's
// 32-bit shared::cta address, the CTA's rank in its cluster, the cluster barrier, another CTA's address of a
// variable, and remote reductions, stores and loads.
#if !TOPK_EMULATE && (TOPK_BULK || TOPK_CLUSTERS)
// 32-bit shared::cta address of a generic pointer to shared memory.
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
#endif
#if TOPK_CLUSTERS
#if !TOPK_EMULATE
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// Full cluster barrier with release/acquire semantics: every shared-memory write and remote
// reduction issued by any thread of the cluster before it is visible to all threads after it.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The same barrier in two halves: work between arrive and wait overlaps the other CTAs' arrival.
__device__ __forceinline__ void cluster_arrive() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// shared::cluster address of the same variable in CTA `r`.
__device__ __forceinline__ unsigned mapa_u32(unsigned a, unsigned r) {
    unsigned o;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(o) : "r"(a), "r"(r));
    return o;
}
// Fire-and-forget atomic add into another CTA's shared memory (no round trip).
__device__ __forceinline__ void red_add_cluster(unsigned a, unsigned v) {
    asm volatile("red.relaxed.cluster.shared::cluster.add.u32 [%0], %1;" ::"r"(a), "r"(v) : "memory");
}
// Atomic add into another CTA's shared memory that returns the old value (one round trip).
__device__ __forceinline__ unsigned atom_add_cluster(unsigned a, unsigned v) {
    unsigned old;
    asm volatile("atom.relaxed.cluster.shared::cluster.add.u32 %0, [%1], %2;" : "=r"(old) : "r"(a), "r"(v) : "memory");
    return old;
}
// One or two words into another CTA's shared memory (ordered by the next cluster barrier).
__device__ __forceinline__ void st_cluster_u32(unsigned a, unsigned x) {
    asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(a), "r"(x) : "memory");
}
__device__ __forceinline__ void st_cluster_v2(unsigned a, unsigned x, unsigned y) {
    asm volatile("st.shared::cluster.v2.u32 [%0], {%1, %2};" ::"r"(a), "r"(x), "r"(y) : "memory");
}
// A word of another CTA's shared memory (written before the last cluster barrier).
__device__ __forceinline__ unsigned ld_cluster_u32(unsigned a) {
    unsigned v;
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(a) : "memory");
    return v;
}
#endif  // !TOPK_EMULATE
#endif  // TOPK_CLUSTERS

// ---------------------------------------------------------------------------------------
// __launch_bounds__(threads, ctas): CUDA's second argument is the CTAs per multiprocessor the kernel promises to fit
// (it caps registers at 64K / (threads * ctas)); HIP's is the minimum waves per execution unit (SIMD; a CU has 4),
// so the same promise of `ctas` CTAs per CU reads ctas * threads / (warp width * 4) there.
#if TOPK_HIP
#define TOPK_LAUNCH_BOUNDS(threads, ctas) __launch_bounds__(threads, (ctas) * (threads) / (TOPK_WARP_SIZE * 4))
#else
#define TOPK_LAUNCH_BOUNDS(threads, ctas) __launch_bounds__(threads, ctas)
#endif

// ---------------------------------------------------------------------------------------
// Warp shuffles and votes over the whole warp: CUDA's take a 32-bit lane mask (every lane), HIP's none (64 lanes).
#if TOPK_HIP
__device__ __forceinline__ int warp_all(bool p) { return __all(p); }
__device__ __forceinline__ int warp_any(bool p) { return __any(p); }
__device__ __forceinline__ unsigned shfl_idx(unsigned v, int src) { return __shfl(v, src); }
__device__ __forceinline__ unsigned shfl_up(unsigned v, int d) { return __shfl_up(v, d); }
#else
#define TOPK_FULL_MASK 0xFFFFFFFFu
__device__ __forceinline__ int warp_all(bool p) { return __all_sync(TOPK_FULL_MASK, p); }
__device__ __forceinline__ int warp_any(bool p) { return __any_sync(TOPK_FULL_MASK, p); }
__device__ __forceinline__ unsigned shfl_idx(unsigned v, int src) { return __shfl_sync(TOPK_FULL_MASK, v, src); }
__device__ __forceinline__ unsigned shfl_up(unsigned v, int d) { return __shfl_up_sync(TOPK_FULL_MASK, v, d); }
#endif

// The warp's votes as a lane mask (bit l: lane l), 64 bits wide for either warp width.
#if TOPK_HIP
__device__ __forceinline__ unsigned long long warp_ballot(bool p) { return __ballot(p); }
#else
__device__ __forceinline__ unsigned long long warp_ballot(bool p) { return __ballot_sync(TOPK_FULL_MASK, p); }
#endif

// Adds one to H[bin] (shared memory) for every calling lane, the lanes of a warp that name the same bin aggregated
// into one atomic: keys bunched in a few bins (the top bins of a row's candidates, ties) would otherwise serialise on
// one address.  Any subset of a warp's lanes may call it.  NVIDIA sm_70+ (__match_any_sync); a plain atomic elsewhere.
__device__ __forceinline__ void hist_add_one(unsigned* H, unsigned bin) {
#if !TOPK_EMULATE && !TOPK_HIP && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 700)
    const unsigned peers = __match_any_sync(__activemask(), bin);
    if ((threadIdx.x & 31u) == (unsigned)(__ffs(peers) - 1)) atomicAdd(&H[bin], (unsigned)__popc(peers));
#else
    atomicAdd(&H[bin], 1u);
#endif
}

// A value other CTAs of the launch wrote (read past L1: CUDA's ld.global.cg; HIP's volatile load): an int or a
// uint2 (the fused selection's candidates).
template <class T>
__device__ __forceinline__ T load_cg(const T* p) {
#if TOPK_HIP
    return *reinterpret_cast<const volatile T*>(p);
#else
    return __ldcg(p);
#endif
}

// Words shared by the CTAs of one cooperative launch (grid_topk.cu), at device (GPU / agent) scope: a 64-bit load
// with acquire semantics, a 64-bit store with release semantics, a full fence (release before an arrival, acquire
// after one) and a pause between the polls of a spin wait.  Only a launch whose whole grid is co-resident (a
// cooperative launch) may wait on another CTA.  Under TOPK_EMULATE the emulator defines them
// (cuda_emulator_grid.h: its pause lets the other emulated threads run).
#if !TOPK_EMULATE
#if TOPK_HIP
__device__ __forceinline__ unsigned long long grid_load_acquire(const unsigned long long* p) {
    return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
}
__device__ __forceinline__ void grid_store_release(unsigned long long* p, unsigned long long v) {
    __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT);
}
__device__ __forceinline__ void grid_pause() { __builtin_amdgcn_s_sleep(1); }
#else
__device__ __forceinline__ unsigned long long grid_load_acquire(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void grid_store_release(unsigned long long* p, unsigned long long v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void grid_pause() { __nanosleep(32); }
#endif
__device__ __forceinline__ void grid_fence() { __threadfence(); }
#endif

// The GPU's global timer (debug stamps only: fused_select.cu's phase boundaries): CUDA's %globaltimer in ns; HIP's
// constant-rate wall clock (wall_clock64: ticks of the device's wall clock, 100 MHz on gfx942, not ns).  Under
// TOPK_EMULATE the emulator defines it (cuda_emulator_grid.h: the host's steady clock in ns).
#if !TOPK_EMULATE
__device__ __forceinline__ unsigned long long qsa_clock_ns() {
#if TOPK_HIP
    return (unsigned long long)wall_clock64();
#else
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
#endif
}
#endif

// Debug stamps: QSA_STAMP_COUNT timer words a CTA (a record), in the order of these phase boundaries (fused_select.cu);
// qsa_stamp(record, phase) has thread 0 write one, and does nothing where the record is null (production).
#define QSA_STAMP_COUNT 9
enum {
    QSA_STAMP_START = 0,  // the kernel's start
    QSA_STAMP_QUERY,      // q and the rows' visible counts loaded
    QSA_STAMP_SCORE,      // the group's scores in the stash
    QSA_STAMP_MERGE,      // the keys and histograms, merged into the rows' (returning atomics), and the gates
    QSA_STAMP_OFFER,      // the candidates offered
    QSA_STAMP_ARRIVE,     // the arrival on the group's counter
    QSA_STAMP_GATHER,     // the finish (only the CTAs that select write these): the threshold's first digit and the
                          // candidates' offsets, the candidates in shared memory
    QSA_STAMP_SELECT,     // the radix select over them and the ties
    QSA_STAMP_FINISH      // the ordered output and the expansion
};
static_assert(QSA_STAMP_FINISH + 1 == QSA_STAMP_COUNT, "one stamp a phase boundary");
__device__ __forceinline__ void qsa_stamp(unsigned long long* record, int phase) {
    if (record != nullptr && threadIdx.x == 0) record[phase] = qsa_clock_ns();
}

// A programmatic dependent launch (CUDA sm_90+) may start while the kernel before it on the stream still runs: every
// kernel waits for that one and its writes before its first global read.  A no-op in any other launch or target.
__device__ __forceinline__ void wait_for_prior_grid() {
#if !TOPK_EMULATE && !TOPK_HIP && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

#endif  // QSA_NATIVE_COMPAT_H
