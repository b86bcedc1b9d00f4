// cuda_emulator_grid.h -- the cooperative-grid side of the CUDA emulator (cuda_emulator.h, included before this
// header): the cross-CTA primitives of native_compat.h that a cooperative launch's kernels use (grid_topk.cu).
//
// A cooperative launch (emulated.run(..., cooperative=True)) runs every CTA of its grid together, as one cluster of
// the whole grid: a CTA that waits on a word another CTA writes (a spin wait through grid_pause) gives the other
// emulated threads their turn, and a wait that no thread can end is reported as a deadlock (a spinning thread makes
// no progress).  Loads and stores are plain and the fences do nothing: one thread runs at a time, so every
// interleaving the emulator runs is sequentially consistent (what it proves is the protocol's logic, not its memory
// ordering on a GPU).
#pragma once

#include <chrono>

inline unsigned long long grid_load_acquire(const unsigned long long* p) { return *p; }
inline void grid_store_release(unsigned long long* p, unsigned long long v) { *p = v; }
inline void grid_fence() {}
inline void grid_pause() { emu::yield(); }
// The debug stamps' timer (native_compat.h's qsa_clock_ns): the host's steady clock in ns, monotonic across the
// emulated threads (one runs at a time).
inline unsigned long long qsa_clock_ns() {
    return (unsigned long long)std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}
