// native_mma.h -- the matrix primitives of the native scorer (native_scorer.cu), one small inline function each:
// 16- and 4-byte asynchronous copies into shared memory, the 8x8 shared-memory matrix loads of a warp, the 16x8x16
// warp MMA with fp32 accumulation, and the warp's xor shuffle of a float.  The scorer calls only these, so the AMD
// versions (global_load_lds / ds_read, v_mfma_f32_16x16x16bf16 / f16, wave64 shuffles) go here later with the same
// signatures, and the CPU emulator (runtime/jit/cuda_emulator.h) defines them under TOPK_EMULATE.  native_scorer.py
// splices this file (and native_compat.h, which it needs) into the source NVRTC compiles.
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16" with .bf16/.f16 inputs, fp32 accumulators), for lane
// l = 4 g + t of a warp (g = l / 4 in 0..7, t = l % 4); each 32-bit register holds two 16-bit elements, the lower
// index in the low half:
//   A (16 x 16, row-major)  a[0] = A[g][2t, 2t+1]   a[1] = A[g+8][2t, 2t+1]   a[2] = A[g][2t+8, 2t+9]
//                           a[3] = A[g+8][2t+8, 2t+9]
//   B (16 x 8, "col")       b0 = B[2t, 2t+1][g]     b1 = B[2t+8, 2t+9][g]
//   C, D (16 x 8, fp32)     d[0] = D[g][2t]   d[1] = D[g][2t+1]   d[2] = D[g+8][2t]   d[3] = D[g+8][2t+1]
// ldmatrix (.x4, no transpose): lanes 8j .. 8j+7 give the addresses of the 8 rows (16 bytes each) of matrix j, and
// lane l receives in r[j] the two elements (row l / 4, columns 2 (l % 4), +1) of matrix j: with the keys as rows
// (key n = row, head_dim k = column), that is the B fragment of the keys.
#ifndef QSA_NATIVE_MMA_H
#define QSA_NATIVE_MMA_H

#if TOPK_HIP
// The AMD versions (MFMA) are not written yet: the spec offers no variant for gfx targets.
#error "native_mma.h: the matrix primitives are NVIDIA's (cp.async, ldmatrix, mma.sync); no AMD MFMA version yet"
#endif

#if !TOPK_EMULATE
// 32-bit shared::cta address of a generic pointer into shared memory.
__device__ __forceinline__ unsigned mma_smem_address(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes from global memory (16-byte aligned) to shared memory (16-byte aligned), asynchronously, bypassing L1;
// src_bytes < 16 fills the rest with zeros (0: nothing is read, `src` is never dereferenced).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, unsigned src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(mma_smem_address(dst)), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}
// 4 bytes from global memory to shared memory (both 4-byte aligned), asynchronously (through L1: .cg takes 16 only);
// src_bytes 0 writes zeros and reads nothing.  The quantised keys' per-key scales.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, unsigned src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(mma_smem_address(dst)), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}
// Closes the group of the copies this thread issued since the last commit.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Four 8x8 matrices of 16-bit elements from shared memory (each lane gives one 16-byte row address).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(mma_smem_address(row)));
}

// d += A * B for one 16x8x16 tile: bf16 (F16 false) or fp16 (F16 true) inputs, fp32 accumulators.
template <bool F16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    if (F16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}
#endif  // !TOPK_EMULATE

// The float of lane (this lane xor `mask`), over the whole warp.
__device__ __forceinline__ float shfl_xor_f32(float v, int mask) { return __shfl_xor_sync(0xFFFFFFFFu, v, mask); }

#endif  // QSA_NATIVE_MMA_H
