"""Numeric bounds that report their measured margin."""
import os


def within(what: str, value: float, tol: float) -> None:
    """assert value <= tol, naming the margin; with HETERMOE_MARGIN_LOG=FILE each check is also
    appended there (one JSON line), so a run under each ATEN_CPU_CAPABILITY shows every
    tolerance's measured margin (README "Parity")."""
    import json

    log = os.environ.get("HETERMOE_MARGIN_LOG")
    if log:
        import torch

        with open(log, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "what": what,
                                "value": value, "tol": tol,
                                "kernels": torch.backends.cpu.get_cpu_capability()}) + "\n")
    assert value <= tol, f"{what}: measured {value:.3e} exceeds the bound {tol:.1e}"
