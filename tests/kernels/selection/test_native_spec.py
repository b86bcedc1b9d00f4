"""The native top-k's declaration (``kernels/native_spec.py``, ``native_topk.SPEC``): the source's parameter macros
spell the declared parameter list, and every derived view (pointers, scalars, the emulator's binding, the launch's
arguments) comes from it; the targets and the variants per target; the catalog names every kernel."""

from __future__ import annotations

import pytest

from qsa_aiter.kernels import catalog
from qsa_aiter.kernels.native_spec import Param, macro_params, params, target_of
from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.selection import native_topk as nt

SPEC = nt.SPEC


@pytest.mark.parametrize("macro, declared", [("TOPK_ROW_PARAMS", nt.ROW_PARAMS), ("TOPK_CL_PARAMS", nt.CLUSTER_PARAMS)])
def test_the_source_spells_the_declared_parameters(macro, declared):
    assert macro_params(nt.source(), macro) == declared


def test_macro_params_reads_types_and_pointers():
    text = "#define P \\\n    const float *__restrict__ a, int *b,  \\\n    int n\nint x;\n"
    assert macro_params(text, "P") == (Param("a", "const float*"), Param("b", "int*"), Param("n", "int"))
    with pytest.raises(ValueError, match="macro: the source does not define Q"):
        macro_params(text, "Q")
    with pytest.raises(ValueError, match=r"pairs: parameter names repeat \(a\)"):
        params(("a", "int"), ("a", "int*"))


def test_every_view_of_the_parameters_is_derived():
    for variant in nt.VARIANTS:
        assert SPEC.pointers(variant) == nt.POINTERS
        scalars = nt.CLUSTER_SCALARS if variant.cluster > 1 else nt.ROW_SCALARS
        assert SPEC.scalars(variant) == scalars
        plan = (nt.cluster_plan(variant.cluster, 20000, Platform.named("sm_90")) if variant.cluster > 1
                else nt.rows_plan(variant.threads, 4096, Platform.named("sm_90")))
        call = nt.launch_arguments(plan, 3, 4096, 4096, 64, True)
        assert call.pointers == nt.POINTERS and tuple(name for name, _, _ in call.scalars) == scalars
    binding = dict((name, (pointers, count)) for name, pointers, count in SPEC.emulator_kernels())
    assert binding["topk_rows_256"] == (tuple(c for _, c in nt.POINTERS), len(nt.ROW_SCALARS))
    assert binding["topk_cluster8_512"][1] == len(nt.CLUSTER_SCALARS)


def test_targets_and_their_variants():
    assert target_of("sm_90").defines == ("TOPK_WARP_SIZE=32",) and target_of("sm_90").runtime_compiler == "nvrtc"
    for arch in ("gfx942", "gfx950"):
        target = target_of(arch)
        assert (target.vendor, target.runtime_compiler, target.defines, target.binary_suffix) == (
            "hip", "hiprtc", ("TOPK_WARP_SIZE=64",), ".hsaco")
        assert [v.name for v in SPEC.variants_for(Platform.named(arch))] == ["topk_rows_256", "topk_rows_512"]
    with pytest.raises(ValueError, match="arch must be an NVIDIA sm_XY or one of gfx942, gfx950; got 'gfx1100'"):
        target_of("gfx1100")
    assert SPEC.defines(nt.BY_NAME["topk_rows_512"], "gfx942") == (
        "TOPK_SINGLE", "TOPK_KERNEL_topk_rows_512", "TOPK_WARP_SIZE=64")
    assert len(SPEC.variants_for(Platform.named("sm_90"))) == len(nt.VARIANTS)


class _Problem:
    rows, columns, block_topk = 1, 65536, 512


def test_no_cluster_is_planned_on_rocm_and_explain_says_why():
    assert nt.SPEC.plan(_Problem(), Platform.named("sm_90")).variant.cluster > 1
    for arch in ("gfx942", "gfx950"):
        platform = Platform.named(arch)
        assert SPEC.plan(_Problem(), platform).variant.cluster == 1
        assert all(not name.startswith("cluster") for name in nt.plans_for(1, 65536, 512, platform))
        assert SPEC.describe_plan(_Problem(), platform).endswith(
            "clusters compiled out on ROCm (one workgroup per row)")
        assert SPEC.reasons(_Problem(), platform) == []


def test_the_catalog_names_every_kernel():
    assert catalog.native_spec_named("native_topk") is SPEC
    with pytest.raises(ValueError, match="kernel must be one of native_topk, grid_topk, native_scorer, fused_select; got 'x'"):
        catalog.native_spec_named("x")
    names = [s.name for s in catalog.SPECS] + [s.name for s in catalog.NATIVE_SPECS]
    assert len(names) == len(set(names))
    assert catalog.family_names("scoring") == ("tiled", "stacked", "keys_major", "rowwise")
