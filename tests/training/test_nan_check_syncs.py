"""The NaN guard reads the host once per clean step, however many parameters a rank holds (issue
43 item 7), and still names the rank, role, layer and parameter of a fault, in every mode.

Two launched gloo ranks, each with a NanGuard over a few parameters whose gradients sit in
`main_grad` as under Megatron's DDP; tests/sync_count.py counts what a GPU run would synchronize on.
"""
import sys
from pathlib import Path

import pytest
import torch

from megatron_hetermoe.parallel.launcher import launch
from megatron_hetermoe.training.nan_check import NanInjection

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sync_count import HostSyncs  # noqa: E402

PARAMS = 12  # the old guard read each parameter's flag: 12 + 2 reads a step


class _Chunk:
    """What NanGuard wraps on a DDP chunk: its finish_grad_sync (here: nothing to reduce)."""

    def finish_grad_sync(self):
        return None


def _steps(rank: int, world: int, mode: str, steps: int, injection) -> dict:
    from megatron_hetermoe.training.nan_check import NanGuard

    g = torch.Generator().manual_seed(rank)
    params = [torch.nn.Parameter(torch.randn(3, 4, generator=g)) for _ in range(PARAMS)]
    names = {p: f"decoder.layers.{i // 4}.mlp.w{i % 4}.weight" for i, p in enumerate(params)}
    chunk = _Chunk()
    guard = NanGuard(mode, [chunk], names, rank, "attention" if rank == 0 else "expert", injection=injection,
                     device=torch.device("cpu"))
    out = {"syncs": [], "skipped": [], "error": None}
    for it in range(steps):
        for p in params:
            p.main_grad = torch.randn(p.shape, generator=g)  # the step's local gradient (DDP's buffer)
        loss = torch.tensor([2.5, 8.0])  # [loss sum, tokens] of one microbatch
        with HostSyncs() as syncs:
            try:
                chunk.finish_grad_sync()
                if guard.after_backward(it, [loss]):
                    out["skipped"].append(it)
            except Exception as e:  # stop: every rank raises; keep the message and the count
                out["error"] = f"{type(e).__name__}: {e}"
        out["syncs"].append(syncs.sites())
        if out["error"]:
            break
    return out


def test_a_clean_step_reads_the_host_once():
    for rank, got in enumerate(launch(_steps, 2, "stop", 3, None, timeout_s=120)):
        assert got["error"] is None and got["skipped"] == []
        for it, sites in enumerate(got["syncs"]):
            assert len(sites) == 1, f"rank {rank} step {it}: {len(sites)} host reads: {sites}"


def test_skip_drops_the_faulty_step_on_every_rank_and_reads_once_on_the_others():
    inj = NanInjection(step=1, rank=1, param="layers.2.mlp.w1")
    for rank, got in enumerate(launch(_steps, 2, "skip", 3, inj, timeout_s=120)):
        assert got["skipped"] == [1], rank
        assert [len(s) for i, s in enumerate(got["syncs"]) if i != 1] == [1, 1], got["syncs"]


def test_stop_names_rank_role_layer_and_parameter_on_every_rank():
    inj = NanInjection(step=2, rank=1, param="layers.0.mlp.w3")
    for rank, got in enumerate(launch(_steps, 2, "stop", 4, inj, timeout_s=120)):
        assert got["error"] is not None, rank
        assert ("NonFiniteError: non-finite loss or gradient at iteration 3 (--check-for-nan-in-loss-and-grad "
                "stop): rank 1 (expert) layer 0: gradient of decoder.layers.0.mlp.w3.weight has 1 non-finite "
                "of 12 values") in got["error"], got["error"]
        assert len(got["syncs"]) == 3  # stopped at the third step


def test_a_non_finite_loss_is_found_without_a_read_per_microbatch():
    inj = NanInjection(step=0, rank=0, target="loss")
    for rank, got in enumerate(launch(_steps, 2, "stop", 2, inj, timeout_s=120)):
        assert "rank 0 (attention): non-finite local loss" in got["error"], got["error"]
        assert "gradient of" not in got["error"]


def test_off_reads_nothing_and_lets_the_fault_through():
    inj = NanInjection(step=0, rank=0, param="layers.1.mlp.w0")
    for got in launch(_steps, 2, "off", 2, inj, timeout_s=120):
        assert got["error"] is None and got["skipped"] == []
        assert got["syncs"] == [[], []]


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_every_parameter_is_checked_with_grad_when_there_is_no_main_grad(mode):
    from megatron_hetermoe.training.nan_check import NanGuard

    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    a.grad, b.grad = torch.zeros(2), torch.tensor([0.0, float("inf"), float("nan")])
    guard = NanGuard(mode, [], {a: "embedding.word_embeddings.weight", b: "output_layer.weight"}, 0, "megatron",
                     device=torch.device("cpu"))
    guard._scan_grads()
    found = guard._findings(torch.zeros(2), guard._scan)
    assert [str(f) for f in found] == ["rank 0 (megatron) output layer: gradient of output_layer.weight has 2 "
                                       "non-finite of 3 values"]
