"""``benchmarks/native_variants.py``: the plans it times beside the op's (``other_plans``), and its options (the work
points' only: the source's measured switches it used to build are decided and gone)."""

import pytest

from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.selection import native_topk as nt

import benchmark_scripts

native_variants = benchmark_scripts.load("native_variants")
H200 = Platform.named("sm_90")


@pytest.mark.parametrize("rows, columns", [(36, 32768), (256, 8192)])
def test_other_plans_are_every_plan_but_the_chosen_one(rows, columns):
    chosen = nt.choose_plan(rows, columns, 512, H200)
    others = native_variants.other_plans(rows, columns, 512, chosen, H200)
    assert chosen not in others.values()
    served = nt.plans_for(rows, columns, 512, H200)
    assert {name: plan for name, plan in others.items() if name in served} == {
        name: plan for name, plan in served.items() if plan != chosen}
    few = others["rows_256_few_candidates"]
    assert few.variant.name == "topk_rows_256" and few.candidates == nt.MIN_CANDIDATES


@pytest.mark.parametrize("option", ["--switches", "--also", "--no-other-plans"])
def test_the_switch_options_are_gone(option, capsys):
    with pytest.raises(SystemExit):
        native_variants.build_parser().parse_args([option, "x"])
    assert "unrecognized arguments" in capsys.readouterr().err
