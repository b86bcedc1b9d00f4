"""The package's layering: no module-level import circle anywhere in ``qsa_aiter``, and the kernel modules (the
``@triton.jit`` code and the specs declaring it) reach no policy layer (registry, tuned tables, settings, the JIT
cache, the public ops, tools), directly or through what they import."""

from __future__ import annotations

from qsa_aiter import catalog

from helpers import MODULES, top_level_imports

#: Layers a kernel module must not reach.
POLICY = ("qsa_aiter.registry", "qsa_aiter.catalog", "qsa_aiter.tuning", "qsa_aiter.settings", "qsa_aiter.jit",
          "qsa_aiter.tools", "qsa_aiter.backends", "qsa_aiter.scoring.op", "qsa_aiter.selection.ops",
          "qsa_aiter.cache.op", "qsa_aiter.custom_ops", "qsa_aiter.integrations")


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
    kernel_modules |= {"qsa_aiter.spec", "qsa_aiter.platform", "qsa_aiter.scoring.tiles", "qsa_aiter.scoring.base",
                       "qsa_aiter.quant.dequant"}
    assert {"qsa_aiter.scoring.stacked", "qsa_aiter.selection.topk", "qsa_aiter.cache.cache_writer"} <= kernel_modules
    for name in sorted(kernel_modules):
        reached, todo = set(), [name]
        while todo:
            for dependency in GRAPH[todo.pop()]:
                if dependency not in reached:
                    reached.add(dependency)
                    todo.append(dependency)
        assert not {m for m in reached if m.startswith(POLICY)}, name
