"""The package's layering: no module-level import circle anywhere in ``qsa_aiter``, and the kernel modules (the
``@triton.jit`` code and the specs declaring it) reach no policy layer (registry, tuned tables, settings, the JIT
cache, the public ops, tools), directly or through what they import."""

from __future__ import annotations

from qsa_aiter.kernels import catalog

from helpers import MODULES, top_level_imports

#: Layers a kernel module must not reach.
POLICY = ("qsa_aiter.runtime.dispatch", "qsa_aiter.kernels.catalog", "qsa_aiter.tuning", "qsa_aiter.runtime.settings", "qsa_aiter.runtime.jit",
          "qsa_aiter.tools", "qsa_aiter.runtime", "qsa_aiter.ops.scoring", "qsa_aiter.ops.selection",
          "qsa_aiter.ops.cache", "qsa_aiter.ops.custom_ops", "qsa_aiter.integrations")


GRAPH = {name: {m for m in top_level_imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}


def test_no_module_level_import_circle():
    done, active = set(), []

    def visit(name):
        assert name not in active, f"import circle: {' -> '.join(active[active.index(name):] + [name])}"
        if name in done:
            return
        active.append(name)
        for dependency in sorted(GRAPH[name]):
            visit(dependency)
        active.pop()
        done.add(name)

    for name in sorted(GRAPH):
        visit(name)


def test_kernel_modules_reach_no_policy_layer():
    kernel_modules = {type(spec).__module__ for spec in catalog.SPECS}  # each spec is declared beside its kernel
    kernel_modules |= {"qsa_aiter.kernels.spec", "qsa_aiter.kernels.platform", "qsa_aiter.kernels.scoring.tiles", "qsa_aiter.kernels.scoring.base",
                       "qsa_aiter.kernels.quant.dequant"}
    assert {"qsa_aiter.kernels.scoring.stacked", "qsa_aiter.kernels.selection.topk", "qsa_aiter.kernels.cache.writer"} <= kernel_modules
    for name in sorted(kernel_modules):
        reached, todo = set(), [name]
        while todo:
            for dependency in GRAPH[todo.pop()]:
                if dependency not in reached:
                    reached.add(dependency)
                    todo.append(dependency)
        assert not {m for m in reached if m.startswith(POLICY)}, name
