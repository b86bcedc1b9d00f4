"""``benchmarks/native_variants.py``'s options: ``--also`` builds (``LABEL:NAME=VALUE+NAME=VALUE;...``) and
``--switches`` (names of ``native_topk.CANDIDATE_SWITCHES``), malformed or unknown ones refused naming the option."""

import argparse

import pytest

from qsa_aiter.kernels.selection import native_topk as nt

import benchmark_scripts

native_variants = benchmark_scripts.load("native_variants")


def test_also_builds_are_labelled_define_lists():
    builds = native_variants.extra_builds("plain_loads:TOPK_BULK=0;both:TOPK_BULK=0+TOPK_HIST=3;")
    assert builds == {"plain_loads": ("TOPK_BULK=0",), "both": ("TOPK_BULK=0", "TOPK_HIST=3")}
    assert native_variants.extra_builds("") == {}


@pytest.mark.parametrize("text", ["TOPK_BULK=0", "label:", ":TOPK_BULK=0", "label:TOPK_BULK"])
def test_a_malformed_also_build_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="--also"):
        native_variants.extra_builds(text)


def test_switches_are_candidate_switch_names():
    names = list(nt.CANDIDATE_SWITCHES)[:2]
    assert native_variants.switch_names(",".join(names)) == tuple(names)
    with pytest.raises(argparse.ArgumentTypeError, match="--switches: unknown"):
        native_variants.switch_names(f"{names[0]},no_such_switch")
