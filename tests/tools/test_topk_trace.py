"""``benchmarks/topk_trace.py``: its stage table from a trace (the boundaries a CTA did not pass and the CTAs not
traced are left out, each stage timed from the CTA's previous boundary), and the trace build of the native kernels
compiles for sm_90 with its buffer (NVRTC; CI installs it)."""


import pytest
import torch

from qsa_aiter.kernels.selection import native_topk as nt
from qsa_aiter.runtime.jit import nvrtc

import benchmark_scripts

topk_trace = benchmark_scripts.load("topk_trace")


def test_stage_times():
    trace = torch.zeros((3, topk_trace.SLOTS), dtype=torch.int64)
    # CTA 0 and 1: 2 ns per cycle; CTA 1 skips stage 2; CTA 2 was never traced (no start time)
    for cta, clocks in ((0, {0: 100, 1: 110, 2: 150, 3: 400, 29: 600}), (1, {0: 50, 1: 70, 3: 250, 29: 550})):
        for slot, clock in clocks.items():
            trace[cta, slot] = clock
        trace[cta, topk_trace.START_NS] = 1000 + cta * 40
        trace[cta, topk_trace.END_NS] = trace[cta, topk_trace.START_NS] + 2 * (clocks[29] - clocks[0])
    ns_per_cycle, stages = topk_trace.stage_times(trace)
    assert ns_per_cycle == pytest.approx(2.0)
    by_name = {name: (median, largest, ctas) for name, median, largest, ctas in stages}
    assert by_name[topk_trace.STAGES[1]] == (pytest.approx(20.0), pytest.approx(40.0), 2)
    assert by_name[topk_trace.STAGES[2]] == (pytest.approx(80.0), pytest.approx(80.0), 1)
    # stage 3 from stage 2 (CTA 0: 250 cycles) or, where stage 2 was not passed, from stage 1 (CTA 1: 180 cycles)
    assert by_name[topk_trace.STAGES[3]][1] == pytest.approx(500.0) and by_name[topk_trace.STAGES[3]][2] == 2
    assert list(by_name) == [topk_trace.STAGES[s] for s in (1, 2, 3, 29)]
    with pytest.raises(ValueError, match="no CTA was traced"):
        topk_trace.stage_times(torch.zeros((2, topk_trace.SLOTS), dtype=torch.int64))


def test_every_boundary_the_table_names_is_marked_in_the_source():
    source = nt.source()
    for slot in topk_trace.STAGES:
        assert f"TRACE({slot});" in source, slot
    assert f"TRACE_NS({topk_trace.START_NS});" in source and f"TRACE_NS({topk_trace.END_NS});" in source
    assert f"#define TOPK_TRACE_SLOTS {topk_trace.SLOTS}" in source


@pytest.mark.nvrtc
@pytest.mark.parametrize("name", ["topk_rows_256", "topk_cluster4_512"])
def test_the_trace_build_compiles_without_spills(name):
    variant = nt.BY_NAME[name]
    built = nvrtc.compile_cubin(nt.source(), "sm_90", (*[f"-D{d}" for d in variant.defines], "-DTOPK_TRACE=64"),
                                name="native_topk.cu")
    assert b"topk_trace" in built.cubin
    report = nvrtc.ptxas_report(built.log)[name]
    assert report.spill_store_bytes == 0 and report.registers <= variant.max_registers
