"""Numeric faults: Megatron's --check-for-nan-in-loss-and-grad for both trainers.

Every rank scans its own gradients *before* the data-parallel reduction (a NaN spreads to every
replica once reduced, and then nobody can say where it came from) and its own local loss; then
one all-reduce over the world decides for every rank at once, so all ranks skip or stop
together (no rank waits in a collective that another rank left). Findings name the rank, its
role, the layer and the parameter.

One host read per step, as Megatron's check: the scan counts each parameter's finite gradient
values on the device (one tensor for the step), the loss check stays there too, and the step's
flag is folded into the world all-reduce and read once. Only when it is set does a rank read its
per-parameter counts and the ranks gather the findings.

Modes (TrainConfig.check_for_nan_in_loss_and_grad, flag `--check-for-nan-in-loss-and-grad`):
  stop - Megatron's meaning (its default): every rank raises NonFiniteError naming the culprits.
  skip - the step is dropped on every rank (no optimizer or LR-scheduler step, as Megatron does
         for a step whose gradients overflowed) and training continues.
  off  - no check (`--no-check-for-nan-in-loss-and-grad`).

Test hook: TrainConfig.nan_injection (a NanInjection) writes a NaN into one rank's local
gradient or loss at one step, at the point where a real fault would appear.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_hetermoe.errors import UserError
from megatron_hetermoe.parallel.device import rank_device
from megatron_hetermoe.shims import distributed_data_parallel

NAN_MODES = ("stop", "skip", "off")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


class NonFiniteError(UserError, RuntimeError):
    """A non-finite loss or gradient under --check-for-nan-in-loss-and-grad stop."""


@dataclass(frozen=True)
class NanInjection:
    """Test hook. At iteration `step` (0-based) on rank `rank`: target "grad" sets element 0 of
    the local gradient of the first parameter whose canonical name contains `param` to NaN (just
    before the data-parallel reduction); target "loss" makes the rank's local loss sum NaN."""

    step: int
    rank: int
    target: str = "grad"
    param: str = ""

    def __post_init__(self) -> None:
        if self.target not in ("grad", "loss"):
            raise ValueError(f"NanInjection.target={self.target!r}; use 'grad' or 'loss'")


@dataclass(frozen=True)
class Finding:
    rank: int
    role: str
    what: str  # "loss" or "gradient"
    layer: str  # "layer 3", "embedding", "output layer", ... or "-" for the loss
    param: str  # canonical parameter name ("" for the loss)
    bad: int  # non-finite values
    total: int

    def __str__(self) -> str:
        if self.what == "loss":
            return f"rank {self.rank} ({self.role}): non-finite local loss"
        return (f"rank {self.rank} ({self.role}) {self.layer}: gradient of {self.param} has {self.bad} "
                f"non-finite of {self.total} values")


def layer_of(canonical: str) -> str:
    """Where a canonical parameter sits, in words."""
    m = _LAYER.match(canonical)
    if m:
        return f"layer {m.group(1)}"
    for prefix, where in (("embedding.", "embedding"), ("output_layer.", "output layer"),
                          ("decoder.final_layernorm.", "final layernorm")):
        if canonical.startswith(prefix):
            return where
    return canonical.rsplit(".", 1)[0]


@dataclass(frozen=True)
class _GradScan:
    """One step's gradient scan: the parameters' canonical names, sizes and finite-value counts
    (on the device)."""
    names: list[str]
    numels: list[int]
    finite: torch.Tensor


class NanGuard:
    """One per training run and rank. `chunks`: the DDP-wrapped model chunks (their
    finish_grad_sync is wrapped to scan local gradients first); `names`: parameter -> canonical
    name; `group`: the group all ranks agree over (the world); `device`: the rank's device
    (default: parallel.device.rank_device())."""

    def __init__(self, mode: str, chunks: list, names: dict[torch.nn.Parameter, str], rank: int, role: str,
                 group=None, injection: NanInjection | None = None, device: torch.device | None = None):
        if mode not in NAN_MODES:
            raise ValueError(f"check_for_nan_in_loss_and_grad={mode!r}; use one of {list(NAN_MODES)}")
        self.mode, self.names, self.rank, self.role, self.group = mode, names, rank, role, group
        self.device = device if device is not None else rank_device()
        self.injection = injection if injection is not None and injection.rank == rank else None
        self.iteration = 0  # advanced by after_backward; start() sets it for a resumed run
        self._scan: _GradScan | None = None  # this step's, once its gradients are scanned
        self.skipped: list[int] = []
        if self.injection is not None and self.injection.target == "grad":
            self._inject_into = next((p for p, n in names.items() if self.injection.param in n), None)
            if self._inject_into is None:
                raise ValueError(f"NanInjection.param={self.injection.param!r} matches no parameter on rank {rank}")
        if mode == "off" and self.injection is None:
            return
        for chunk in chunks:
            distributed_data_parallel.before_finish_grad_sync(chunk, self._scan_grads)

    def _due(self, target: str) -> bool:
        inj = self.injection
        return inj is not None and inj.target == target and inj.step == self.iteration

    def _scan_grads(self) -> None:
        if self._due("grad"):
            g = self._inject_into.main_grad
            g.view(-1)[0] = float("nan")
        if self.mode == "off" or self._scan is not None:  # off: wrapped only to inject; one scan a step
            return
        names, numels, grads = [], [], []
        for p, name in self.names.items():
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            if g is not None:
                names.append(name)
                numels.append(g.numel())
                grads.append(g)
        if grads:  # on the device, no read: the step's one read is after_backward's
            self._scan = _GradScan(names, numels, torch.stack([torch.isfinite(g).sum() for g in grads]))

    def after_backward(self, iteration: int, local_losses: list[torch.Tensor]) -> bool:
        """Collective over `group`: every rank calls it once per step after its backward (and
        the gradient reduction), with its local per-microbatch [loss sum, tokens] tensors (none
        where no loss is computed). Returns True when the step must be skipped; raises
        NonFiniteError to stop."""
        if local_losses and self._due("loss"):
            local_losses[0].view(-1)[0] = float("nan")  # in place: the reported loss shows it too
        scan, self._scan = self._scan, None
        self.iteration = iteration + 1  # the scan of the next step's gradients belongs to it
        if self.mode == "off":
            return False
        # [local loss non-finite, gradient values non-finite] as 0/1, built on the device (a
        # torch.tensor of Python values would be a blocking copy to it).
        flags = torch.zeros(2, device=self.device)
        if local_losses:
            losses = torch.cat([t.detach().reshape(-1).float() for t in local_losses])
            flags[0] = torch.isfinite(losses).all().logical_not()
        if scan is not None:
            flags[1] = scan.finite.sum() != sum(scan.numels)
        flag = flags.max().reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() == 0:  # the step's one host read
            return False
        found = self._findings(flags, scan)
        world = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(world, found, group=self.group)
        findings = [f for per_rank in world for f in per_rank]
        head = (f"non-finite loss or gradient at iteration {iteration + 1} "
                f"(--check-for-nan-in-loss-and-grad {self.mode}): ")
        detail = ("; ".join(str(f) for f in findings[:8])
                  + (f"; ... {len(findings) - 8} more" if len(findings) > 8 else ""))
        if self.mode == "stop":
            raise NonFiniteError(head + detail + ". Lower --lr, check the data, or pass "
                                 "--check-for-nan-in-loss-and-grad skip to drop such steps")
        self.skipped.append(iteration)
        if self.rank == 0:
            print(f" skipping iteration {iteration + 1}: {head}{detail}", flush=True)
        return True

    def _findings(self, flags: torch.Tensor, scan: "_GradScan | None") -> list[Finding]:
        """This rank's findings, read from the device in one copy (only on a step some rank flagged)."""
        if scan is None:
            loss_bad, finite = bool(flags[0].item()), []
        else:
            loss_bad, *finite = torch.cat([flags[:1].to(scan.finite.dtype), scan.finite]).tolist()
        found = [Finding(self.rank, self.role, "loss", "-", "", 1, 1)] if loss_bad else []
        if scan is not None:
            for name, numel, ok in zip(scan.names, scan.numels, finite):
                if ok != numel:
                    found.append(Finding(self.rank, self.role, "gradient", layer_of(name), name, numel - ok, numel))
        return found

    def start(self, iteration: int) -> None:
        """Set the iteration the next forward/backward belongs to (needed only when a run does
        not start at iteration 0)."""
        self.iteration = iteration
