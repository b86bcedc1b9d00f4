"""The package's layers (docs/architecture.md): ``kernels`` at the bottom, the launch-time ``runtime`` above it, the
public ``ops`` and engine ``integrations`` above that, the offline ``tools`` on top. A module imports from its own
layer and the layers below, never from above (a few named exceptions), no module-level import circle exists, and
importing ``qsa_aiter`` or calling its public ops loads no offline module."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import MODULES, all_imports, assert_no_import_circle, top_level_imports

#: Layer of each top-level part of the package, lowest first.
LAYERS = {"kernels": 0, "runtime": 1, "ops": 2, "integrations": 2, "qsa_aiter": 2, "tools": 3, "__main__": 3}

#: Imports that go up a layer, ``(importer, imported): why``; at most five may ever be listed. None today.
UPWARD: dict[tuple[str, str], str] = {}


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else "qsa_aiter"]


GRAPH = {name: {m for m in top_level_imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}


def test_every_module_has_a_layer():
    assert {name.split(".")[1] for name in MODULES if "." in name} <= set(LAYERS)


def test_imports_go_down_the_layers():
    upward = set()
    for name, path in sorted(MODULES.items()):
        for imported in all_imports(path):
            if imported in MODULES and imported != "qsa_aiter" and layer(imported) > layer(name):
                upward.add((name, imported))
    assert upward <= set(UPWARD), sorted(upward - set(UPWARD))
    assert len(UPWARD) <= 5


def test_kernel_modules_import_only_kernel_modules():
    for name, path in sorted(MODULES.items()):
        if name.startswith("qsa_aiter.kernels"):
            outside = {m for m in all_imports(path) if m in MODULES and not m.startswith("qsa_aiter.kernels")}
            assert not outside, f"{name} imports {sorted(outside)}"


def test_no_module_level_import_circle():
    assert_no_import_circle(GRAPH)


_PUBLIC_CALLS = r"""
import json, sys, torch
import qsa_aiter
from qsa_aiter.integrations import atom  # the engine adapter is launch-time code too
after_import = sorted(m for m in sys.modules if m.startswith("qsa_aiter.tools"))
gen = torch.Generator().manual_seed(0)
pages, page, dim = 4, 16, 32
cache = torch.randn(pages, page, 1, dim, generator=gen).to(torch.bfloat16)
table = torch.arange(pages, dtype=torch.int32).view(2, 2)
t2r = torch.tensor([0, 0, 1], dtype=torch.int32)
pos = torch.tensor([90, 91, 120], dtype=torch.int32)
ctx = torch.tensor([92, 121], dtype=torch.int32)
q = torch.randn(3, 4, dim, generator=gen).to(torch.bfloat16)
logits, visible = qsa_aiter.qsa_paged_mqa_logits(q, cache, table, t2r, pos, ctx, 4)
groups = qsa_aiter.qsa_block_topk(logits, visible, 8)
qsa_aiter.qsa_expand_block_indices(groups, pos, ctx, t2r, 4, 32)
qsa_aiter.qsa_select_paged_tokens(q, cache, table, t2r, pos, ctx, 32, 4)
qsa_aiter.explain_selection(q, cache, table, t2r, pos, ctx, 32, 4)
qsa_aiter.explain(q, cache, table, t2r, pos, ctx, 4)
fp8, scale = qsa_aiter.allocate_index_cache("fp8", pages, page, dim)
qsa_aiter.qsa_write_index_cache(torch.randn(pages * page, dim, generator=gen), torch.arange(pages * page), fp8, scale)
atom.qsa_select_paged_tokens(q, cache, table, t2r, pos, ctx, 32, 4)
print("LOADED", json.dumps([after_import, sorted(m for m in sys.modules if m.startswith("qsa_aiter.tools"))]))
"""


def test_public_calls_load_no_offline_module():
    """``import qsa_aiter`` and a call of every public op (torch paths on the CPU, outside the interpreter) import
    nothing of ``qsa_aiter.tools``."""
    proc = subprocess.run([sys.executable, "-c", _PUBLIC_CALLS], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    after_import, after_calls = json.loads(proc.stdout.split("LOADED ", 1)[1])
    assert after_import == [] and after_calls == [], (after_import, after_calls)
