"""Every tensor the runtime allocates lives on the rank's device.

A factory call such as torch.zeros(2) without `device=` makes a CPU tensor; on a GPU rank it
then meets CUDA tensors in an op (an error) or NCCL in a collective (an error, or a hang). CPU
tests never see that, so this AST check fails on any such call in the runtime packages.
*_like factories are fine: they inherit their argument's device.

ALLOWED lists the calls that mean a CPU tensor, each with its reason; an entry that no longer
matches a call fails too, so the list stays exact.
"""
from __future__ import annotations

import ast
from pathlib import Path

import megatron_hetermoe

PKG = Path(megatron_hetermoe.__file__).parent
RUNTIME_PACKAGES = ("parallel", "models", "schedules", "training", "reliability", "checkpoint", "emulation", "shims")
FACTORIES = frozenset({"zeros", "empty", "ones", "full", "tensor", "arange", "rand", "randn", "randint",
                       "randperm", "linspace", "logspace", "eye", "empty_strided", "scalar_tensor"})

# Modules that hold no runtime tensors (host-only code), with why.
HOST_ONLY: dict[str, str] = {
    "parallel/launcher.py": "forks CPU ranks and reads their results; allocates no tensors",
    "parallel/cpu_backend.py": "the CPU patches: only ever active on CPU ranks",
}

# (module, enclosing function) -> why a CPU tensor is intended there.
ALLOWED: dict[tuple[str, str], str] = {
    ("models/builder.py", "canonical_init"):
        "layout-invariant initial values from a CPU generator (the same numbers on every device), "
        "copied into the parameters before the model moves to its device",
    ("shims/distrib_optimizer.py", "_state_dict_from_step_0"):
        "torch's Adam keeps each parameter's `step` as a CPU tensor (neither capturable nor fused)",
    ("shims/distrib_optimizer.py", "_load_at_the_saved_step"):
        "torch's Adam keeps each parameter's `step` as a CPU tensor (neither capturable nor fused)",
}


def bad_calls(source: str, filename: str = "<src>") -> list[tuple[str, int, str]]:
    """(enclosing function, line, call) for every torch factory call without `device=`.
    The enclosing function is dotted through classes and defs ("" at module level)."""
    out: list[tuple[str, int, str]] = []

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, scope + (child.name,))
                continue
            if isinstance(child, ast.Call):
                f = child.func
                if (isinstance(f, ast.Attribute) and f.attr in FACTORIES and isinstance(f.value, ast.Name)
                        and f.value.id == "torch" and not any(k.arg == "device" for k in child.keywords)):
                    out.append((".".join(scope), child.lineno, f"torch.{f.attr}"))
            visit(child, scope)

    visit(ast.parse(source, filename), ())
    return out


def runtime_modules() -> list[str]:
    return sorted(str(p.relative_to(PKG)) for pkg in RUNTIME_PACKAGES for p in (PKG / pkg).glob("*.py"))


def test_runtime_allocates_on_the_rank_device():
    found, used = [], set()
    for rel in runtime_modules():
        if rel in HOST_ONLY:
            continue
        for func, line, call in bad_calls((PKG / rel).read_text(), rel):
            if (rel, func) in ALLOWED:
                used.add((rel, func))
            else:
                found.append(f"{rel}:{line} {call}(...) in {func or '<module>'}")
    assert not found, (
        "tensors allocated without device= (a CPU tensor on a GPU rank): " + "; ".join(found)
        + ". Pass device= (HeteroParallelState.device, parallel.device.rank_device(), or an input's "
        ".device), use a *_like factory, or add (module, function) to ALLOWED with the reason a CPU "
        "tensor is meant")
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"ALLOWED entries that match no call any more (remove them): {stale}"
    missing = sorted(set(HOST_ONLY) - set(runtime_modules()))
    assert not missing, f"HOST_ONLY names modules that do not exist (remove them): {missing}"


def test_the_checker_flags_a_cpu_allocation():
    src = """
import torch
x = torch.zeros(2)
class A:
    def f(self, d, t):
        a = torch.ones(3, dtype=torch.float64)
        b = torch.tensor([1], device=d)
        c = torch.zeros_like(t)
        def g():
            return torch.empty(0, 4)
        return torch.cat([a, b, c])
"""
    assert bad_calls(src) == [("", 3, "torch.zeros"), ("A.f", 6, "torch.ones"), ("A.f.g", 10, "torch.empty")]
