"""Tuned tile configurations: CSV validation, nearest-bucket lookup, merging of QSA_AITER_TUNED_CONFIG files, and
a launch that uses a tuned row (on the GPU when there is one, else arch ``cpu``: the interpreter)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from qsa_aiter.runtime import dispatch
from qsa_aiter.runtime.log import reset_log_once
from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.scoring import stacked
from qsa_aiter.ops.scoring import describe_call
from qsa_aiter.runtime.settings import get_settings
from qsa_aiter.runtime import tuned

from helpers import check_forced, phase_batch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PLATFORM = Platform.of(DEVICE)
ARCH = PLATFORM.arch  # the key of rows that launches on this machine read


def lookup(arch: str, kernel: str, problem):
    """The row a launch on ``arch`` would use, with the tuned files of the current settings."""
    return tuned.load_tables(tuple(get_settings().tuned_config)).lookup(arch, kernel, problem)

HEADER = ("arch,kernel,kv_dtype,page_size,heads,head_dim,rows,context,block_rows,block_m,block_n,d_chunk,num_warps,"
          "num_stages,programs_per_sm,column_programs,scalar_pages,us,measured,source\n")


def write_table(tmp_path, name: str, *rows: str):
    path = tmp_path / name
    path.write_text(HEADER + "".join(row + "\n" for row in rows))
    return path


def use_tables(monkeypatch, *paths) -> None:
    monkeypatch.setenv("QSA_AITER_TUNED_CONFIG", ":".join(str(p) for p in paths))


def test_shipped_tables_load():
    table = tuned.load_tables(())
    rows = table.rows[("gfx950", "stacked", "bf16", 64, 4, 128)]
    assert rows[0].tile() == {"block_rows": 4, "block_n": 32, "num_warps": 2, "column_programs": 256}
    assert rows[0].measured is False


@pytest.mark.parametrize("kernel", ["rowwise", "stacked", "tiled"])
@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp4"])
@pytest.mark.parametrize("page", [16, 64])
def test_the_h200_rows_cover_every_kernel_dtype_and_page(kernel, kv, page):
    """Measured sm_90 rows for each kernel x kv dtype x page size, by the tuner: each is at least as fast as the
    kernel's default at that point (the default is one of the candidates it timed)."""
    rows = tuned.load_tables(()).rows.get(("sm_90", kernel, kv, page, 4, 128), [])
    assert len(rows) >= 2, f"no tuned H200 rows for {kernel} {kv} page {page}"
    for row in rows:
        assert row.measured and row.source.startswith("python -m qsa_aiter tune at ")
        assert row.us is not None and row.default_us is not None and row.us <= row.default_us


@pytest.mark.parametrize("row,message", [
    ("sm_90,stacked,bf16,64,4,128,36,131072,4,,x,,2,,,,,,1,", r"bad\.csv:3: block_n"),
    ("sm_90,flash,bf16,64,4,128,36,131072,4,,32,,2,,,,,,1,", r"bad\.csv:3: kernel: .*unknown kernel 'flash'"),
    ("sm_90,stacked,bf8,64,4,128,36,131072,4,,32,,2,,,,,,1,", r"bad\.csv:3: kv_dtype"),
    ("sm_90,stacked,bf16,64,4,128,0,131072,4,,32,,2,,,,,,1,", r"bad\.csv:3: rows"),
    ("sm_90,stacked,bf16,64,4,128,36,131072,,64,32,,2,,,,,,1,", r"bad\.csv:3: block_m is not a setting of the stacked"),
    ("sm_90,tiled,bf16,64,4,128,36,131072,,64,32,,2,,,,,,,", r"bad\.csv:3: measured"),
    ("sm_90,stacked,bf16,64,4,128,36,131072,4,,32,,2,,,,,,1,,extra", r"bad\.csv:3: more cells"),
])
def test_a_malformed_row_is_an_error_naming_file_and_line(tmp_path, row, message):
    good = "sm_90,stacked,bf16,64,4,128,36,131072,4,,32,,2,,,,,,1,"
    path = write_table(tmp_path, "bad.csv", good, row)
    with pytest.raises(ValueError, match=message):
        tuned.read_table(path)


@pytest.mark.parametrize("text,message", [
    ("", r"empty\.csv: empty; a tuned table starts with a header line naming its columns \(arch, kernel, "),
    ("gpu-node-17\n", (r"empty\.csv:1: not a tuned-table header: unknown column\(s\) 'gpu-node-17'; missing "
                       r"column\(s\) arch, kernel, kv_dtype, page_size, heads, head_dim, rows, context, measured")),
    ("arch,kernel,kv_dtype,page_size,heads,head_dim,rows,context\n",
     r"empty\.csv:1: not a tuned-table header: missing column\(s\) measured"),
])
def test_a_file_that_is_no_tuned_table_is_an_error(tmp_path, text, message):
    """A file read as a table must start with a tuned table's header: a one-line text file (a header without rows to
    ``csv``) or an empty file is refused rather than read as a table without rows."""
    path = tmp_path / "empty.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        tuned.read_table(path)


def test_a_header_without_rows_is_an_empty_table(tmp_path):
    assert tuned.read_table(write_table(tmp_path, "none.csv")) == []


def test_a_register_cap_is_an_nvidia_setting(tmp_path):
    """``max_registers`` (ptxas's ``maxnreg``) reaches the launch options of a row's config; on an AMD arch, whose
    backend has no such option, the row is an error naming the file and line."""
    from qsa_aiter.kernels.scoring.stacked import SPEC, StackedConfig

    header = "arch,kernel,kv_dtype,page_size,heads,head_dim,rows,context,block_n,max_registers,measured\n"
    row = "sm_90,stacked,fp4,64,4,128,256,100352,64,80,1\n"
    path = tmp_path / "caps.csv"
    path.write_text(header + row)
    cap = tuned.read_table(path)[0].tile()["max_registers"]
    assert SPEC.options(StackedConfig(max_registers=cap)) == {"num_warps": 4, "num_stages": 2, "maxnreg": 80}
    assert "maxnreg" not in SPEC.options(StackedConfig())
    path.write_text(header + row.replace("sm_90", "gfx950"))
    with pytest.raises(ValueError, match=r"caps\.csv:2: max_registers .*NVIDIA archs \(sm_\*\) only, not gfx950"):
        tuned.read_table(path)


def test_nearest_bucket_and_merging(tmp_path, monkeypatch):
    base = write_table(tmp_path, "base.csv",
                       "cpu,stacked,bf16,16,4,64,4,4096,,,32,,,,,,,10.0,1,small",
                       "cpu,stacked,bf16,16,4,64,64,262144,,,64,,,,,,,20.0,1,large")
    override = write_table(tmp_path, "override.csv", "cpu,stacked,bf16,16,4,64,64,262144,,,128,,,,,,,15.0,1,better")
    use_tables(monkeypatch, base)

    def problem(rows: int, columns: int):
        return dataclasses.replace(_problem(), num_tokens=rows, num_columns=columns)

    assert lookup("cpu", "stacked", problem(4, 1024)).source == "small"
    assert lookup("cpu", "stacked", problem(48, 60000)).source == "large"
    assert lookup("cpu", "stacked", problem(8, 2048)).source == "small"
    assert lookup("sm_90", "stacked", problem(4, 1024)) is None
    use_tables(monkeypatch, base, override)
    row = lookup("cpu", "stacked", problem(48, 60000))
    assert row.source == "better" and row.block_n == 128


def test_a_missing_file_is_named(monkeypatch, tmp_path):
    use_tables(monkeypatch, tmp_path / "nowhere.csv")
    with pytest.raises(ValueError, match="QSA_AITER_TUNED_CONFIG=.* is invalid: .*nowhere.csv is not a file"):
        lookup("cpu", "stacked", _problem())


def test_no_row_keeps_the_default_and_logs_once(monkeypatch, caplog):
    monkeypatch.delenv("QSA_AITER_TUNED_CONFIG", raising=False)
    monkeypatch.setenv("QSA_AITER_LOG_LEVEL", "info")
    reset_log_once()
    cpu = Platform.of(torch.device("cpu"))
    default = stacked.SPEC.default_config(_problem(), cpu)
    with caplog.at_level(logging.INFO, logger="qsa_aiter"):
        for _ in range(3):
            plan = dispatch.plan_for(stacked.SPEC, _problem(), cpu)
            assert plan.config == default and plan.config_source.startswith("defaults")
    messages = [r.getMessage() for r in caplog.records if "no tuned stacked config" in r.getMessage()]
    assert len(messages) == 1 and "arch=cpu kv=bf16 page=16 heads=4 head_dim=64" in messages[0]


def test_a_launch_uses_the_tuned_row(tmp_path, monkeypatch, rng):
    """A tuned row for this shape changes the tile the stacked kernel runs with, and the scores stay right."""
    batch, hints = phase_batch("verify", 16, rng, device=DEVICE)
    path = write_table(tmp_path, "tuned.csv", f"{ARCH},stacked,bf16,16,4,64,11,4096,4,,16,,2,,,3,1,,1,test")
    use_tables(monkeypatch, path)
    problem = describe_call(*batch.args(), **hints)
    plan = dispatch.plan_for(stacked.SPEC, problem, PLATFORM)
    cfg = plan.config
    assert (cfg.block_n, cfg.num_warps, cfg.column_programs, cfg.scalar_pages) == (16, 2, 3, 1)
    assert plan.grid[1] == 3 and plan.constexprs["BLOCK_N"] == 16 and plan.options["num_warps"] == 2
    check_forced(monkeypatch, "stacked", batch, hints, label="tuned stacked")


def _problem():
    gen = torch.Generator().manual_seed(0)
    batch, hints = phase_batch("verify", 16, gen)
    return describe_call(*batch.args(), **hints)


def test_explain_names_the_tile_source(tmp_path, monkeypatch, rng):
    import qsa_aiter

    batch, hints = phase_batch("verify", 16, rng, device=DEVICE)
    monkeypatch.delenv("QSA_AITER_TUNED_CONFIG", raising=False)
    assert (f"plan (arch {ARCH}): grid (" in qsa_aiter.explain(*batch.args(), **hints)
            and f"defaults (no tuned row for arch {ARCH}): StackedConfig(" in qsa_aiter.explain(*batch.args(), **hints))
    path = write_table(tmp_path, "tuned.csv", f"{ARCH},stacked,bf16,16,4,64,11,4096,,,16,,2,,,,,,1,my sweep")
    use_tables(monkeypatch, path)
    text = qsa_aiter.explain(*batch.args(), **hints)
    assert "tuned row rows=11 context=4096 (my sweep): StackedConfig(" in text
    assert "block_n=16" in text


def test_every_tile_config_field_is_a_column_with_its_bounds(tmp_path):
    """The tables' tile columns are the tunable specs' config fields (a new kernel's fields need no edit); a 0/1
    switch refuses 2, a count where 0 means "derived" takes 0, any other field refuses 0."""
    from qsa_aiter.kernels.catalog import tunable_specs

    for spec in tunable_specs():
        for item in dataclasses.fields(spec.Config):
            assert item.name in tuned.TunedRow.model_fields, (spec.name, item.name)
    path = tmp_path / "t.csv"
    header = HEADER.replace("scalar_pages", "stack_heads")
    path.write_text(header + "sm_90,tiled,bf16,64,4,128,4096,131072,,,,,,,,,1,,1,\n")
    assert tuned.read_table(path)[0].tile() == {"stack_heads": 1}
    path.write_text(header + "sm_90,tiled,bf16,64,4,128,4096,131072,,,,,,,,,2,,1,\n")
    with pytest.raises(ValueError, match="stack_heads"):
        tuned.read_table(path)
    path.write_text(HEADER + "sm_90,stacked,bf16,64,4,128,36,131072,,,,,,,,0,,,1,\n")
    assert tuned.read_table(path)[0].tile() == {"column_programs": 0}
    path.write_text(HEADER + "sm_90,stacked,bf16,64,4,128,36,131072,,,0,,,,,,,,1,\n")
    with pytest.raises(ValueError, match="block_n"):
        tuned.read_table(path)


def test_every_amd_kernel_format_and_page_size_has_a_row_and_model_rows_say_so():
    """gfx942 and gfx950 have a shipped row for every MFMA scorer x kv dtype x page size (the static model's, or one
    reported from the hardware), every model row is marked not measured, and a launch plan on such a row says where
    its config came from."""
    from qsa_aiter.kernels import catalog
    from qsa_aiter.tools.static_model import FORMATS, KERNELS, MODEL_SOURCE, PAGE_SIZES, TARGETS, model_problem

    table = tuned.load_tables(())
    for arch in TARGETS:
        for kernel in KERNELS:
            for kv in FORMATS:
                for page in PAGE_SIZES:
                    rows = table.get((arch, kernel, kv, page, 4, 128))
                    assert rows, (arch, kernel, kv, page)
                    for row in rows:
                        if row.source.startswith(MODEL_SOURCE):
                            assert not row.measured and row.us is None, row
                    problem = model_problem(kernel, arch, kv, page)
                    plan = catalog.spec_named(kernel).plan(problem, Platform.named(arch), table)
                    assert plan.config_source.startswith("tuned row"), plan.config_source
                    if all(r.source.startswith(MODEL_SOURCE) for r in rows):
                        assert "(model, not measured:" in plan.config_source, plan.config_source


# ---------------------------------------------------------------------------------------------------------------
# The block top-k's table (configs/topk.csv)
# ---------------------------------------------------------------------------------------------------------------

TOPK_HEADER = "arch,block_topk,rows,columns,candidate,plan,us,measured,source\n"


def write_topk_table(tmp_path, name: str, *rows: str):
    path = tmp_path / name
    path.write_text(TOPK_HEADER + "".join(row + "\n" for row in rows))
    return path


def _topk(rows: int, columns: int, block_topk: int = 512):
    from qsa_aiter.runtime.registries import TopkProblem

    return TopkProblem("cuda", rows, columns, block_topk, fused=True)


def test_the_shipped_topk_table_holds_no_invented_measurement():
    """The shipped top-k table is read as one (its header names ``candidate``); a measured row in it is the tuner's,
    any other says it was not measured."""
    path = tuned.CONFIG_DIR / "topk.csv"
    assert "topk.csv" in tuned.SHIPPED and path.is_file()
    with open(path) as handle:
        assert tuned.check_header(path, handle.readline().strip().split(",")) is tuned.TOPK_TABLE
    for row in tuned.read_table(path):
        if row.measured:
            assert row.source.startswith("python -m qsa_aiter tune --op topk at "), row
        else:
            assert "not measured" in row.source, row


@pytest.mark.parametrize("row,message", [
    ("sm_90,512,64,8192,torch,,9.0,1,x", r"topk\.csv:3: candidate: .*unknown top-k candidate 'torch' \(candidates "
                                         r"with tuned rows: native, triton\)|unknown top-k candidate 'torch'"),
    ("sm_90,512,64,8192,native,cluster3,9.0,1,x", r"topk\.csv:3: plan: .*'cluster3' is not a plan of the native top-k "
                                                  r"\(plans: rows_256, rows_512, rows_512_uncached, cluster2"),
    ("sm_90,512,64,8192,native,,9.0,1,x", r"topk\.csv:3: plan: .*a native row names its plan"),
    ("sm_90,512,64,8192,triton,rows_256,9.0,1,x", r"topk\.csv:3: plan: .*the triton top-k has one plan"),
    ("sm_90,512,64,8192,triton,,,1,x", r"topk\.csv:3: measured: .*a measured row \(measured=1\) gives its time"),
    ("sm_90,512,64,8192,triton,,-2,1,x", r"topk\.csv:3: us: "),
    ("sm_90,512,0,8192,triton,,9.0,1,x", r"topk\.csv:3: rows: "),
    ("sm_90,0,64,8192,triton,,9.0,1,x", r"topk\.csv:3: block_topk: "),
    ("sm_90,512,64,8192,triton,,9.0,,x", r"topk\.csv:3: measured: "),
    ("sm_90,512,64,8192,triton,,9.0,1,x,extra", r"topk\.csv:3: more cells"),
])
def test_a_malformed_topk_row_is_an_error_naming_file_line_and_column(tmp_path, row, message):
    good = "sm_90,512,64,8192,native,rows_256,16.7,1,x"
    path = write_topk_table(tmp_path, "topk.csv", good, row)
    with pytest.raises(ValueError, match=message):
        tuned.read_table(path)


@pytest.mark.parametrize("header,message", [
    ("arch,block_topk,rows,columns,candidate,kernel,measured\n",
     r"t\.csv:1: not a top-k tuned-table header: unknown column\(s\) 'kernel' \(a top-k table's header names arch, "
     r"block_topk, rows, columns, candidate, measured and any of plan, us, source\)"),
    ("arch,rows,columns,candidate,measured\n", r"t\.csv:1: not a top-k tuned-table header: missing column\(s\) "
                                               r"block_topk"),
])
def test_a_topk_header_is_checked_as_one(tmp_path, header, message):
    path = tmp_path / "t.csv"
    path.write_text(header)
    with pytest.raises(ValueError, match=message):
        tuned.read_table(path)


def test_a_header_of_neither_kind_names_both(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arch,rows,columns\n")
    with pytest.raises(ValueError, match=r"not a tuned-table header: .*; a top-k table's names arch, block_topk"):
        tuned.read_table(path)


def test_tuned_config_files_of_both_kinds_merge_by_their_own_keys(tmp_path, monkeypatch, without_shipped_topk_rows):
    scoring = write_table(tmp_path, "scoring.csv", "cpu,stacked,bf16,16,4,64,4,4096,,,32,,,,,,,10.0,1,small")
    first = write_topk_table(tmp_path, "a.csv", "sm_90,512,64,8192,triton,,11.2,1,a",
                             "sm_90,512,64,8192,native,rows_256,16.7,1,a")
    second = write_topk_table(tmp_path, "b.csv", "sm_90,512,64,8192,native,rows_256,9.5,1,b",
                              "sm_90,512,64,8192,native,cluster4,17.4,1,b")
    use_tables(monkeypatch, scoring, first, second)
    table = tuned.load_tables(tuple(get_settings().tuned_config))
    assert lookup("cpu", "stacked", _problem()).source == "small"
    native = table.measured_topk("sm_90", "native", _topk(64, 8192))
    assert [(r.plan, r.us, r.source) for r in native] == [("rows_256", 9.5, "b"), ("cluster4", 17.4, "b")]
    assert [r.us for r in table.measured_topk("sm_90", "triton", _topk(64, 8192))] == [11.2]


def test_topk_rows_are_looked_up_at_the_nearest_measured_bucket(tmp_path, monkeypatch, without_shipped_topk_rows):
    path = write_topk_table(tmp_path, "t.csv",
                            "sm_90,512,64,8192,triton,,11.2,1,small", "sm_90,512,256,25088,triton,,20.0,1,large",
                            "sm_90,512,36,32768,triton,,5.0,0,not measured: a report",
                            "sm_90,256,64,8192,triton,,3.0,1,other block_topk")
    use_tables(monkeypatch, path)
    table = tuned.load_tables(tuple(get_settings().tuned_config))

    def source(rows, columns, block_topk=512, arch="sm_90"):
        found = table.measured_topk(arch, "triton", _topk(rows, columns, block_topk))
        return found[0].source if found else None

    assert source(64, 8192) == "small" and source(48, 6000) == "small"
    assert source(256, 24000) == "large" and source(128, 20000) == "large"
    assert source(36, 32768) == "small"  # the measured=0 row at this very bucket is not a measurement
    assert source(64, 8192, block_topk=256) == "other block_topk"
    assert source(64, 8192, block_topk=1024) is None and source(64, 8192, arch="sm_80") is None


def test_a_bad_topk_file_in_the_variable_is_a_configuration_error(tmp_path, monkeypatch):
    from qsa_aiter.runtime.settings import ConfigurationError

    path = write_topk_table(tmp_path, "t.csv", "sm_90,512,64,8192,native,cluster3,9.0,1,x")
    use_tables(monkeypatch, path)
    with pytest.raises(ConfigurationError, match=r"QSA_AITER_TUNED_CONFIG=.* is invalid: .*t\.csv:2: plan: "):
        tuned.load_tables(tuple(get_settings().tuned_config))


def test_the_topk_columns_table_in_the_docs_is_generated():
    from pathlib import Path

    from qsa_aiter.kernels.selection.native_topk import PLAN_NAMES

    docs = Path(__file__).resolve().parents[2] / "docs"
    assert tuned.topk_columns_table() in (docs / "jit_and_configs.md").read_text(), \
        "regenerate the top-k columns table in docs/jit_and_configs.md"
    # docs/selection.md lists the native plans a row may name.
    assert ", ".join(f"`{name}`" for name in PLAN_NAMES) in " ".join((docs / "selection.md").read_text().split())
