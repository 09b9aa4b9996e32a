"""The package's imports flow one way: no module imports (at any depth, function-level and
TYPE_CHECKING imports included) a module that imports it back."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import megatron_hetermoe

PKG = Path(megatron_hetermoe.__file__).parent
NAME = "megatron_hetermoe"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(mod: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every package module `mod` imports, resolving `from a.b import c` to a.b.c when c is a module."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in modules:  # `import a.b.c` of a package path: the deepest module
                n = n.rpartition(".")[0]
            if n.startswith(NAME) and n != mod:
                out.add(n)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (each a set of modules that import each other): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_config_and_planner_import_no_torch():
    # Planning and configuration run where torch is not installed (hetermoe plan, the SLURM
    # renderer): follow their imports transitively and look for torch or megatron at module level.
    graph = import_graph()
    modules = _modules()
    # Every parser too: `hetermoe plan`, `--help` and the SLURM renderer's checks build them.
    cli = sorted(m for m in modules if m.startswith(f"{NAME}.cli"))
    for start in (f"{NAME}.config", f"{NAME}.planner.search", f"{NAME}.plan.hetero_plan", *cli):
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            tree = ast.parse(modules[m].read_text())
            for node in tree.body:  # module level only: function-level imports run on demand
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                    assert not any(n.split(".")[0] in ("torch", "megatron") for n in names), f"{m} imports {names}"
            todo.extend(n for n in graph[m] if _module_level(modules[m], n))


def _module_level(path: Path, target: str) -> bool:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and target.startswith(node.module):
            return True
        if isinstance(node, ast.Import) and any(target.startswith(a.name) for a in node.names):
            return True
    return False


# The packages in ARCHITECTURE.md's order, bottom first: a module may import modules of its own
# layer and of layers below it, never above (function-level and TYPE_CHECKING imports included).
LAYERS: list[set[str]] = [
    {"", "_csim", "errors", "limits", "paths", "outputs", "compat", "config", "layer_pattern", "vocabulary"},
    {"reliability"},
    {"shims"},
    {"plan"},
    {"cli"},
    {"planner"},
    {"parallel"},
    {"models"},
    {"schedules"},
    {"emulation"},
    {"data"},
    {"checkpoint"},
    {"training"},
    {"megatron_lm"},
    {"tools", "commands"},
]


def layer_of(module: str) -> int:
    if module.endswith(".__main__"):  # `python -m` runs it and nothing imports it: an entry point, on top
        return len(LAYERS) - 1
    part = module.split(".")[1] if module.count(".") else ""
    for i, names in enumerate(LAYERS):
        if part in names:
            return i
    raise AssertionError(f"{module}: package {part!r} is in no layer of LAYERS; add it to ARCHITECTURE.md's order")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
                  for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m))


def test_imports_flow_down_the_layers():
    found = upward_imports(import_graph())
    assert not found, "imports that run up ARCHITECTURE.md's order:\n  " + "\n  ".join(found)


def test_the_layering_check_finds_a_planted_upward_import(tmp_path):
    """A function-level import of training from plan, planted in a copy of plan/layout.py's source."""
    modules = _modules()
    planted = tmp_path / "layout.py"
    planted.write_text(modules[f"{NAME}.plan.layout"].read_text()
                       + "\n\ndef _planted():\n    from megatron_hetermoe.training import loop  # noqa\n")
    graph = import_graph()
    graph[f"{NAME}.plan.layout"] = _imports(f"{NAME}.plan.layout", planted, modules)
    assert upward_imports(graph) == [f"{NAME}.plan.layout (layer 3) imports {NAME}.training.loop (layer 12)"]


# Roles, schedule names and task kinds are closed vocabularies (megatron_hetermoe/vocabulary.py):
# code compares against the enum members, never a bare string (a typo there would be silently false).
def _vocabulary() -> dict[str, str]:
    from megatron_hetermoe.vocabulary import Role, ScheduleName, TaskKind

    return {m.value: f"{type(m).__name__}.{m.name}" for e in (Role, ScheduleName, TaskKind) for m in e}


def vocabulary_string_comparisons(path: Path, source: str | None = None) -> list[str]:
    """`x == "zebra"`, `role != "expert"`, `kind in ("D_F", "C_B")`: each with the member to use."""
    words = _vocabulary()
    tree = ast.parse(source if source is not None else path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare) or not all(
                isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            continue
        for side in (node.left, *node.comparators):
            elts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            for e in elts:
                if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value in words:
                    out.append(f"{path.name}:{node.lineno}: {e.value!r} (use {words[e.value]})")
    return out


def test_no_string_comparison_of_a_role_schedule_or_task_kind():
    found = [hit for m, p in sorted(_modules().items()) if m != f"{NAME}.vocabulary"
             for hit in vocabulary_string_comparisons(p)]
    assert not found, "compare with megatron_hetermoe.vocabulary's members:\n  " + "\n  ".join(found)


def test_the_vocabulary_check_finds_planted_comparisons():
    path = _modules()[f"{NAME}.plan.tasks"]
    planted = path.read_text() + ('\n\ndef _planted(t, plan, role):\n'
                                  '    return t.kind in ("D_F", "C_B") or plan.schedule != "zebra" '
                                  'or "expert" == role\n')
    found = vocabulary_string_comparisons(path, planted)
    assert [f.split(": ", 1)[1] for f in found] == [
        "'D_F' (use TaskKind.D_F)", "'C_B' (use TaskKind.C_B)", "'zebra' (use ScheduleName.ZEBRA)",
        "'expert' (use Role.EXPERT)"]
    assert vocabulary_string_comparisons(path) == []


# Every argparse parser of the package is built in cli/ (one module per command): these calls
# anywhere else are a parser outside it. Namespace as a type, or reading parsed args, is not.
PARSER_CALLS = {"ArgumentParser", "add_argument", "add_argument_group", "add_mutually_exclusive_group",
                "add_subparsers", "add_parser"}


def parser_calls(mod: str, path: Path) -> list[str]:
    """`mod:line name` of each parser-building call in the module's source."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in PARSER_CALLS:
                found.append(f"{mod}:{node.lineno} {name}")
    return found


def parsers_outside_cli(modules: dict[str, Path]) -> list[str]:
    return [c for m, p in sorted(modules.items()) if m != f"{NAME}.cli" and not m.startswith(f"{NAME}.cli.")
            for c in parser_calls(m, p)]


def test_no_parser_outside_cli():
    found = parsers_outside_cli(_modules())
    assert not found, "argparse parsers built outside megatron_hetermoe/cli/ (move them there):\n  " + \
        "\n  ".join(found)


def test_the_parser_check_finds_a_planted_parser(tmp_path):
    """A parser planted in a copy of tools/timeline.py's source, and a flag added to a parser there."""
    modules = _modules()
    planted = tmp_path / "timeline.py"
    planted.write_text(modules[f"{NAME}.tools.timeline"].read_text()
                       + "\n\ndef _planted(p):\n    import argparse\n\n    argparse.ArgumentParser()\n"
                       + "    p.add_argument('--x')\n")
    modules[f"{NAME}.tools.timeline"] = planted
    found = parsers_outside_cli(modules)
    assert [f.split(":")[0] for f in found] == [f"{NAME}.tools.timeline"] * 2
    assert sorted(f.split()[-1] for f in found) == ["ArgumentParser", "add_argument"]


# ---- every runtime patch of megatron-core, Megatron-LM or torch lives in shims/ ------------------
# (ARCHITECTURE.md "Where new things plug in"). A patch here is an assignment, setattr/delattr or
# `del` of an attribute of something imported from these packages (or a name bound from such a
# thing: `cls = mod.Class; cls.__init__ = ...`), a row `(module, "name", new)` of a replacement
# table that a helper setattr()s, or an instance patch: replacing a method that
# megatron-core's or torch's classes define (MEGATRON_METHODS) on an object that is not the
# module's own `self`, with a lambda, a functools.partial, a function the module defines, or what a
# function of the module returns when it returns a function it defines (a closure factory:
# `optimizer.count_zeros = world_count_zeros(...)`). Only such method names count: setting our own
# callback slots (EmulatedClock.on_step_begin), a hook field of Megatron's config
# (finalize_model_grads_func, which Megatron-LM sets the same way) or argparse's `error` is not a
# patch; nor is plain data set on an object (`opt.grad_stats_parallel_group = group`).
EXTERNAL = ("megatron", "torch", "transformer_engine", "apex")


@functools.cache
def _megatron_methods() -> frozenset[str]:
    """Every method name of the Megatron and torch classes whose instances the package holds:
    optimizers (chained, distributed, mixed precision), DDP and its bucket groups, the LR
    scheduler, torch's Module and Optimizer."""
    import inspect

    import torch
    from megatron.core import optimizer as mopt
    from megatron.core.distributed import DistributedDataParallel, param_and_grad_buffer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    classes = [c for _, c in inspect.getmembers(mopt, inspect.isclass) if c.__module__.startswith("megatron")]
    classes += [DistributedDataParallel, OptimizerParamScheduler, torch.nn.Module, torch.optim.Optimizer,
                *(c for _, c in inspect.getmembers(param_and_grad_buffer, inspect.isclass))]
    return frozenset(n for c in classes for n, v in inspect.getmembers(c) if callable(v))


def _external_names(tree: ast.AST) -> set[str]:
    """Names bound by imports from EXTERNAL, then names assigned from expressions rooted at one."""
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names if a.name.split(".")[0] in EXTERNAL}
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").split(".")[0] in EXTERNAL:
            names |= {a.asname or a.name for a in n.names}
    changed = True
    while changed:  # `cls = dot_product_attention.DotProductAttention`, `orig = cls.__init__`
        changed = False
        for n in ast.walk(tree):
            if isinstance(n, ast.Assign) and _root(n.value) in names:
                for t in n.targets:
                    if isinstance(t, ast.Name) and t.id not in names:
                        names.add(t.id)
                        changed = True
    return names


def _root(e: ast.AST) -> str | None:
    while isinstance(e, (ast.Attribute, ast.Subscript)):
        e = e.value
    return e.id if isinstance(e, ast.Name) else None


def _function_makers(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(names of the functions the module defines, those of them that return a function they define)."""
    defs, makers = set(), set()
    for f in ast.walk(tree):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs.add(f.name)
            inner = {g.name for g in ast.walk(f) if isinstance(g, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and g is not f}
            for r in ast.walk(f):
                if isinstance(r, ast.Return) and (isinstance(r.value, ast.Lambda)
                                                  or isinstance(r.value, ast.Name) and r.value.id in inner):
                    makers.add(f.name)
    return defs, makers


def _callee(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _is_method_patch(value: ast.AST, defs: set[str], makers: set[str]) -> bool:
    if isinstance(value, ast.Lambda):
        return True
    if isinstance(value, ast.Name):
        return value.id in defs
    if isinstance(value, ast.Call):
        name = _callee(value)
        return name in ("partial", "staticmethod", "classmethod", "MethodType") or name in makers
    return False


def patches_in(source: str, filename: str = "<src>") -> list[str]:
    """Every patch (see above) in a module's source, as 'line: code'."""
    tree = ast.parse(source, filename)
    ext = _external_names(tree)
    defs, makers = _function_makers(tree)
    methods = _megatron_methods()
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign):
            targets, value = n.targets, n.value
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
            targets, value = [n.target], n.value
        elif isinstance(n, ast.Delete):
            targets, value = n.targets, None
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("setattr", "delattr")
              and n.args and _root(n.args[0]) in ext):
            out.append(f"{n.lineno}: {ast.unparse(n)}")
            continue
        elif (isinstance(n, ast.Tuple) and len(n.elts) == 3 and _root(n.elts[0]) in ext
              and isinstance(n.elts[1], ast.Constant) and isinstance(n.elts[1].value, str)):
            # a replacement table's row, (module, "name", new), for a helper that setattr()s it
            out.append(f"{n.lineno}: {ast.unparse(n)[:80]}")
            continue
        else:
            continue
        for t in targets:
            if not isinstance(t, ast.Attribute):
                continue
            if _root(t) in ext:
                out.append(f"{n.lineno}: {ast.unparse(t)}")
            elif t.attr in methods and _root(t) != "self" and (
                    value is None or _is_method_patch(value, defs, makers)):  # `del obj.method` undoes one
                out.append(f"{n.lineno}: {ast.unparse(t)}")
    return sorted(set(out), key=lambda s: int(s.split(":")[0]))


def patches_outside_shims() -> dict[str, list[str]]:
    return {m: found for m, p in sorted(_modules().items())
            if not m.startswith(f"{NAME}.shims") and (found := patches_in(p.read_text(), str(p)))}


def test_no_patch_outside_shims():
    found = patches_outside_shims()
    assert not found, ("runtime patches of megatron-core, Megatron-LM or torch outside megatron_hetermoe/shims/ "
                       "(move each into the shim module named for what it patches):\n  " + "\n  ".join(
                           f"{m}:{p}" for m, ps in found.items() for p in ps))


def test_the_patch_check_finds_a_planted_patch():
    """Module, class and instance patches, planted in a copy of training/loop.py's source."""
    src = _modules()[f"{NAME}.training.loop"].read_text()
    assert patches_in(src) == []
    planted = src + ("\n\ndef _planted(optimizer):\n    import torch\n"
                     "    from megatron.core import parallel_state as ps\n"
                     "    from megatron.core.transformer import torch_norm\n\n"
                     "    torch.cuda.Stream = object\n    setattr(ps, '_TENSOR_MODEL_PARALLEL_GROUP', None)\n"
                     "    cls = torch_norm.WrappedTorchNorm\n    cls.__new__ = None\n"
                     "    optimizer.step = lambda: None\n    table = [(torch.cuda, 'synchronize', print)]\n\n"
                     "    def count():\n        return 0\n\n    optimizer.count_zeros = count\n")
    n = len(src.splitlines()) + 1
    assert patches_in(planted) == [f"{n + 7}: torch.cuda.Stream",
                                   f"{n + 8}: setattr(ps, '_TENSOR_MODEL_PARALLEL_GROUP', None)",
                                   f"{n + 10}: cls.__new__", f"{n + 11}: optimizer.step",
                                   f"{n + 12}: (torch.cuda, 'synchronize', print)", f"{n + 17}: optimizer.count_zeros"]
