"""Plain Megatron on CPU ranks: layouts that must agree do agree, and runs are reproducible."""
import pytest
import torch

from megatron_hetermoe.model_builder import ParallelConfig
from megatron_hetermoe.trainer import TrainConfig, run

pytestmark = pytest.mark.slow
STEPS = 3


def _run(tiny, par, nproc, **kw):
    return run(TrainConfig(tiny, par, train_iters=STEPS, collect_grads=True, quiet=True, **kw), nproc)


def _max_rel(a, b):
    return max((a[k] - b[k]).abs().max().item() / (b[k].abs().max().item() + 1e-12) for k in b)


def assert_same_training(a, b, loss_rtol=1e-6, grad_rtol=1e-5, param_rtol=1e-3):
    """Losses and every step's gradients to fp32 round-off. Final weights get a looser bound:
    Adam divides by sqrt(v), so round-off in a near-zero gradient moves a weight by up to lr."""
    for x, y in zip(a["losses"], b["losses"]):
        assert abs(x - y) <= loss_rtol * abs(y), (a["losses"], b["losses"])
    for ga, gb in zip(a["grads"], b["grads"]):
        assert set(ga) == set(gb)
        assert _max_rel(ga, gb) <= grad_rtol
    assert _max_rel(a["params"], b["params"]) <= param_rtol


@pytest.fixture(scope="module")
def ep1(tiny):
    return _run(tiny, ParallelConfig(), 2)


def test_ep2_alltoall_matches_ep1(tiny, ep1):
    assert_same_training(_run(tiny, ParallelConfig(ep=2), 2), ep1)


def test_ep2_allgather_matches_ep1(tiny, ep1):
    assert_same_training(_run(tiny, ParallelConfig(ep=2, dispatcher="allgather"), 2), ep1)


def test_pp2_1f1b_matches_pp1(tiny):
    assert_same_training(_run(tiny, ParallelConfig(pp=2), 2), _run(tiny, ParallelConfig(), 1))


def test_same_seed_is_bitwise_reproducible(tiny):
    a = _run(tiny, ParallelConfig(ep=2), 4, deterministic=True)
    b = _run(tiny, ParallelConfig(ep=2), 4, deterministic=True)
    assert a["losses"] == b["losses"]
    for ga, gb in zip(a["grads"], b["grads"]):
        assert all(torch.equal(ga[k], gb[k]) for k in gb)


def test_loss_falls(tiny):
    r = run(TrainConfig(tiny, ParallelConfig(ep=2), train_iters=15, lr=3e-3, quiet=True), 2)
    assert r["losses"][-1] < r["losses"][0] - 0.3, r["losses"]
