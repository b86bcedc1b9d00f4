"""``python -m qsa_aiter native-resources``: every native variant of each AMD arch comes from the catalog's specs;
remarks that the code object contradicts, a variant that spills, a compile error and a missing toolchain each fail
the command, naming what; the generated table in docs/selection.md is rewritten in place. Marked ``amd`` (clang and
the HIP headers: ``.ci/amd-toolchain.sh``): the command over every variant, with no scratch and no VGPR spills, and
docs/selection.md's table the one it prints."""

from __future__ import annotations

import pytest

from qsa_aiter.kernels import catalog
from qsa_aiter.kernels.native_spec import AMD_ARCHS
from qsa_aiter.kernels.platform import Platform
from qsa_aiter.runtime.jit import hip_clang
from qsa_aiter.runtime.jit.native_store import Compiled, Resources
from qsa_aiter.tools import native_resources as nr
from qsa_aiter.tools.cli import main

FIGURES = dict(vgprs=62, agprs=0, sgprs=106, scratch=0, dynamic_stack=False, vgpr_spills=0, sgpr_spills=4, lds=0,
               waves=7)


@pytest.mark.amd
def test_every_variant_compiles_without_spills_and_the_docs_table_is_the_commands(capsys):
    assert main(["native-resources", "--fail-on-spills"]) == 0
    out = capsys.readouterr().out
    printed = "\n".join(line for line in out.splitlines() if line.startswith("|"))
    rows = [line.split(" | ")[:2] for line in printed.splitlines()[2:]]
    assert [[r[0].lstrip("| "), r[1]] for r in rows] == [[v.name, arch] for _, v, arch in nr.variants(AMD_ARCHS)]
    assert "0 failed" in out
    section = nr.docs_section(nr.DOCS_PATH.read_text())
    assert printed in section, ("docs/selection.md's native-resources table is not what the command prints: run "
                                "python -m qsa_aiter native-resources --write-docs")


def test_the_variants_are_each_native_familys_for_each_arch():
    found = nr.variants(AMD_ARCHS)
    expected = [(spec.name, v.name, arch) for spec in catalog.NATIVE_SPECS for v in spec.variants for arch in AMD_ARCHS
                if v in spec.variants_for(Platform.named(arch))]
    assert [(s.name, v.name, arch) for s, v, arch in found] == expected and expected
    assert {v.name for _, v, _ in found} == {"topk_rows_256", "topk_rows_512"}  # no cluster kernel on AMD
    assert nr.variants(("gfx950",), ("native_topk",)) == [t for t in found if t[2] == "gfx950"]


class _Compiler:
    """A clang that reports ``remarks`` and whose code object's note says ``note`` (or fails with ``error``)."""

    version, clang = "22.1.8 (HIP 7.2)", "/usr/bin/clang"

    def __init__(self, remarks: dict, note: dict, error: str | None = None):
        self.remarks, self.note, self.error = remarks, note, error

    def compile(self, source, kernel, arch, defines):
        if self.error:
            raise hip_clang.ClangError(self.error)
        log = "\n".join([f"a.cu:1:1: remark: Function Name: {kernel} [-Rpass-analysis=kernel-resource-usage]"]
                        + [f"a.cu:1:1: remark:     {name}: {self.remarks[field]} [-Rpass-analysis=x]"
                           for name, field in hip_clang.REMARK_FIELDS.items() if field in self.remarks])
        return Compiled(b"\x7fELF", log, 1.5, Resources(), "")

    def code_object_notes(self, binary):
        return {"topk_rows_256": self.note}


def _note(**changes) -> dict:
    fields = {**FIGURES, **changes}
    return {field: fields[field] for field in hip_clang.NOTE_FIELDS.values()}


def test_a_build_reads_the_remarks_and_checks_them_against_the_code_object():
    spec, variant, _ = nr.variants(("gfx942",))[0]
    remarks = dict(FIGURES)
    built = nr._build(spec, variant, "gfx942", _Compiler(remarks, _note()))
    assert built == nr.Build("native_topk", "topk_rows_256", "gfx942", hip_clang.AmdResources(**FIGURES), 1.5)
    assert built.row() == ("topk_rows_256", "gfx942", 62, 0, 106, 0, 0, 4, 0, 7)
    disagree = nr._build(spec, variant, "gfx942", _Compiler(remarks, _note(scratch=16, vgpr_spills=2)))
    assert disagree == ("topk_rows_256 on gfx942: clang's remarks and the code object's metadata disagree: scratch 0 "
                        "(remarks) != 16 (code object); vgpr_spills 0 (remarks) != 2 (code object)")
    missing = {k: v for k, v in remarks.items() if k != "waves"}
    assert nr._build(spec, variant, "gfx942", _Compiler(missing, _note())) == (
        "topk_rows_256 on gfx942: clang reported no Occupancy [waves/SIMD] for topk_rows_256")
    assert nr._build(spec, variant, "gfx942", _Compiler(remarks, _note(), error="clang could not compile it")) == (
        "topk_rows_256 on gfx942: clang could not compile it")


def _report(*builds: nr.Build, failures=()) -> nr.Report:
    return nr.Report(list(builds), list(failures), "clang 22.1.8 (HIP 7.2)", 3.0)


def _build(kernel="topk_rows_256", arch="gfx942", **changes) -> nr.Build:
    return nr.Build("native_topk", kernel, arch, hip_clang.AmdResources(**{**FIGURES, **changes}), 1.0)


def test_the_command_fails_on_spills_naming_the_variant(monkeypatch, capsys):
    spilling = _build("topk_rows_512", "gfx950", scratch=16, vgpr_spills=3)
    stack = _build("topk_rows_512", "gfx942", dynamic_stack=True)
    monkeypatch.setattr(nr, "measure", lambda *args: _report(_build(), stack, spilling))
    assert main(["native-resources", "--fail-on-spills"]) == 1
    captured = capsys.readouterr()
    assert "| topk_rows_512 | gfx942 | 62 | 0 | 106 | 0 + dynamic | 0 | 4 | 0 | 7 |" in captured.out
    assert captured.err == ("2 of 3 variants use scratch or spill VGPRs: topk_rows_512 on gfx942 (scratch 0 B per "
                            "lane, a dynamic stack, 0 VGPRs spilled); topk_rows_512 on gfx950 (scratch 16 B per lane, "
                            "3 VGPRs spilled)\n")
    assert main(["native-resources"]) == 0  # reported, not failed
    assert "2 of 3 variants use scratch" in capsys.readouterr().err


def test_the_command_fails_where_a_variant_fails_or_nothing_is_compiled(monkeypatch, capsys):
    monkeypatch.setattr(nr, "measure", lambda *args: _report(_build(), failures=["topk_rows_512 on gfx942: boom"]))
    assert main(["native-resources", "--write-docs"]) == 1
    err = capsys.readouterr().err
    assert "error: topk_rows_512 on gfx942: boom" in err and "--write-docs: not written" in err
    monkeypatch.setattr(nr, "measure", lambda *args: "no clang with the AMDGPU target (clang-22 not found)")
    assert main(["native-resources"]) == 1
    captured = capsys.readouterr()
    assert captured.err == ("error: nothing was compiled or checked: no clang with the AMDGPU target (clang-22 not "
                            "found)\n") and captured.out == ""


def test_the_command_takes_comma_lists_of_archs_and_families(monkeypatch, capsys):
    asked = []
    monkeypatch.setattr(nr, "measure", lambda *args: asked.append(args) or _report(_build()))
    assert main(["native-resources", "--arch", "gfx950,gfx950", "--kernels", "native_topk", "--jobs", "3"]) == 0
    assert asked == [(("gfx950",), ("native_topk",), 3)]
    with pytest.raises(SystemExit) as info:
        main(["native-resources", "--arch", "gfx942,sm_90"])
    assert info.value.code == 2
    assert "--arch: expected a comma-separated subset of gfx942,gfx950; got 'gfx942,sm_90'" in capsys.readouterr().err


def test_a_missing_toolchain_is_named_before_anything_compiles(monkeypatch):
    monkeypatch.setattr(hip_clang, "toolchain", lambda settings=None, arch="gfx942": f"no {arch} bitcode (test)")
    assert nr.measure(AMD_ARCHS) == "no gfx942 bitcode (test)"


def test_write_docs_rewrites_the_generated_part_only(monkeypatch, tmp_path, capsys):
    doc = tmp_path / "selection.md"
    doc.write_text(f"before\n{nr.DOCS_BEGIN}\nold table\n{nr.DOCS_END}\nafter\n")
    report = _report(_build(), _build("topk_rows_256", "gfx950"))
    assert nr.write_docs(report, doc) and not nr.write_docs(report, doc)
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith(f"{nr.DOCS_END}\nafter\n") and "old table" not in text
    assert nr.docs_section(text) == nr.docs_block(report)
    assert "Compiled by clang 22.1.8 (HIP 7.2)" in text and nr.table(report.builds) in text
    doc.write_text("no markers\n")
    with pytest.raises(ValueError, match="has no generated native-resources table"):
        nr.write_docs(report, doc)
    monkeypatch.setattr(nr, "DOCS_PATH", doc)
    monkeypatch.setattr(nr, "measure", lambda *args: report)
    assert main(["native-resources", "--write-docs"]) == 2
    assert "error: --write-docs: the document has no generated native-resources table" in capsys.readouterr().err


def test_the_checkouts_docs_hold_the_generated_table():
    section = nr.docs_section(nr.DOCS_PATH.read_text())
    assert "| " + " | ".join(nr.COLUMNS) + " |" in section
