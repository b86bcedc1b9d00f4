"""The CUDA emulator (``runtime/jit/cuda_emulator.h``, ``runtime/jit/emulated.py``) on small kernels of its own: CTA
barriers, warp collectives and a cluster's distributed shared memory give the results CUDA defines; a read that a
missing barrier leaves unordered sees the other thread's old value; and what a GPU would hang on or fault on (a
barrier nobody opens, a remote address outside the cluster, lanes of one warp in different collectives, a bulk
copy out of shared memory, an mbarrier overwritten while live) is reported as ``EmulationError``."""

from __future__ import annotations

import ctypes

import pytest
import torch

from qsa_aiter.kernels.selection.native_topk import NativeLaunch
from qsa_aiter.runtime.jit import emulated

pytestmark = pytest.mark.skipif(emulated.unavailable_reason() is not None,
                                reason=f"cannot emulate: {emulated.unavailable_reason()}")

SOURCE = r"""
// out[blockIdx.x] = sum over the CTA's threads of (threadIdx.x + mode), through a warp scan and shared memory.
extern "C" __global__ void block_sum(int* out, int mode) {
    TOPK_DYNAMIC_SMEM(s);
    unsigned x = threadIdx.x + mode, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int o = 1; o < 32; o <<= 1) {
        unsigned y = __shfl_up_sync(0xFFFFFFFFu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) s[warp] = x;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned t = 0;
        for (int w = 0; w < 8; ++w) t += s[w];
        out[blockIdx.x] = (int)t;
    }
}
// Thread 0 reads what the last thread writes: with the barrier (mode 1) it sees 7, without it (mode 0) the 0 it
// wrote first.
extern "C" __global__ void ordered_read(int* out, int mode) {
    TOPK_DYNAMIC_SMEM(s);
    if (threadIdx.x == 0) s[0] = 0;
    __syncthreads();
    if (threadIdx.x == 255) s[0] = 7;
    if (mode) __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = (int)s[0];
}
// Every CTA of a cluster of 4 adds (rank + 1) into word 0 of every CTA: each ends with 10; mode 1 adds into rank 4.
extern "C" __global__ void cluster_sum(int* out, int mode) {
    TOPK_DYNAMIC_SMEM(s);
    if (threadIdx.x == 0) s[0] = 0;
    cluster_sync();
    if (threadIdx.x < 4) red_add_cluster(mapa_u32(smem_u32(s), threadIdx.x + (mode ? 1 : 0)), cluster_rank() + 1);
    cluster_sync();
    if (threadIdx.x == 0) out[blockIdx.x] = (int)s[0];
}
// What a GPU would hang on or fault on: mode 0 waits on an mbarrier no copy completes; mode 1 splits a warp over
// two shuffles; mode 2 copies past the CTA's shared memory; mode 3 waits on an mbarrier zeroed after its setup.
extern "C" __global__ void faults(int* out, int mode) {
    TOPK_DYNAMIC_SMEM(s);
    if (mode == 0 || mode == 3) {
        if (threadIdx.x == 0) mbar_init(smem_u32(s), 1);
        __syncthreads();
        if (mode == 3 && threadIdx.x == 1) s[0] = 0u;
        __syncthreads();
        mbar_wait0(smem_u32(s));
    }
    if (mode == 1) out[threadIdx.x] = (int)(threadIdx.x < 16 ? __shfl_sync(0xFFFFFFFFu, 1u, 0)
                                                              : __shfl_sync(0xFFFFFFFFu, 1u, 1));
    if (mode == 2 && threadIdx.x == 0) {
        mbar_init(smem_u32(s), 1);
        mbar_expect_tx(smem_u32(s), 4096);
        bulk_g2s(smem_u32(s) + 16, out, 4096, 0);
    }
}
"""
KERNELS = tuple((name, ("int*",), 1) for name in ("block_sum", "ordered_read", "cluster_sum", "faults"))


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    path = tmp_path_factory.mktemp("emulator") / "kernels.cu"
    path.write_text(SOURCE)
    return emulated.build(path, KERNELS)


def _run(lib, kernel: str, grid: int, mode: int, cluster: int = 1, threads: int = 256, seed: int = 0) -> list[int]:
    out = torch.full((max(grid, threads),), -1, dtype=torch.int32)
    call = NativeLaunch(kernel, (grid, 1, 1), (threads, 1, 1), 1024, (("out", "int*"),), (("mode", "int", mode),))
    emulated.run(lib, call, [out.data_ptr()], cluster, seed)
    return out[:grid].tolist()


def test_barriers_and_warp_collectives(lib):
    assert _run(lib, "block_sum", 3, 0) == [sum(range(256))] * 3
    assert _run(lib, "block_sum", 2, 5, seed=9) == [sum(range(256)) + 5 * 256] * 2


def test_a_missing_barrier_leaves_the_read_unordered(lib):
    assert _run(lib, "ordered_read", 2, 1) == [7, 7]
    assert _run(lib, "ordered_read", 2, 0) == [0, 0]


def test_a_clusters_distributed_shared_memory(lib):
    assert _run(lib, "cluster_sum", 8, 0, cluster=4) == [10] * 8
    assert _run(lib, "cluster_sum", 4, 0, cluster=4, seed=3) == [10] * 4
    with pytest.raises(emulated.EmulationError, match="mapa to a rank outside the cluster"):
        _run(lib, "cluster_sum", 4, 1, cluster=4)


@pytest.mark.parametrize("mode, message", [(0, "deadlock"), (1, "lanes in different calls"),
                                           (2, "bulk copy outside the CTA's shared memory"),
                                           (3, "mbarrier that is not initialised")])
def test_faults_are_reported(lib, mode, message):
    with pytest.raises(emulated.EmulationError, match=message):
        _run(lib, "faults", 1, mode, threads=32)


def test_a_launch_of_another_shape_is_refused(lib):
    with pytest.raises(emulated.EmulationError, match="bad launch shape"):
        _run(lib, "block_sum", 3, 0, cluster=2)
    with pytest.raises(emulated.EmulationError, match="no kernel"):
        _run(lib, "nothing", 1, 0)
    assert ctypes.sizeof(ctypes.c_void_p) == 8
