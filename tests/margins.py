"""Numeric bounds that report their measured margin."""
import os


def within(what: str, value: float, tol: float) -> None:
    """assert value <= tol, naming the margin; with HETERMOE_MARGIN_LOG=FILE each check is also
    appended there (one JSON line), so a run under each ATEN_CPU_CAPABILITY shows every
    tolerance's measured margin (docs/parity.md)."""
    import json

    log = os.environ.get("HETERMOE_MARGIN_LOG")
    if log:
        import torch

        with open(log, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "what": what,
                                "value": value, "tol": tol,
                                "kernels": torch.backends.cpu.get_cpu_capability()}) + "\n")
    assert value <= tol, f"{what}: measured {value:.3e} exceeds the bound {tol:.1e}"


def parity_within(r, free: bool) -> None:
    """A ParityReport (tools/parity.py) within the parity suite's bounds: loss and gradients at
    identical parameters, every gradient category present, and with `free` the free-running
    trajectory's weights and losses."""
    from megatron_hetermoe.tools.parity import (
        FREE_RUN_LOSS_TOL,
        FREE_RUN_PARAM_TOL,
        GRAD_TOL,
        LOSS_TOL,
    )

    within("loss", r.max_rel_loss_diff, LOSS_TOL)
    within("grad", r.max_rel_grad_diff, GRAD_TOL)
    assert set(r.grad_diff_by_category) == {"experts", "router", "attention", "embedding/output"}
    if free:
        within("free-run params", r.max_rel_param_diff_free_run, FREE_RUN_PARAM_TOL)
        within("free-run loss", r.max_rel_loss_diff_free_run, FREE_RUN_LOSS_TOL)
