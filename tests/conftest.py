import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Import megatron once in the pytest process so forked ranks start in milliseconds.
import megatron.core  # noqa: E402,F401
import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_hetermoe.parallel import cpu_backend  # noqa: E402

cpu_backend.apply()


@pytest.fixture(scope="session")
def tiny():
    from megatron_hetermoe.config import ModelConfig

    return ModelConfig.load("tiny")


@pytest.fixture
def one_rank_groups():
    """A one-process gloo world and a ProcessGroupCollection of that one rank, for building
    megatron-core modules outside a HeterMoE job."""
    import tempfile

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
    try:
        one = dist.new_group([0])
        ps._set_global_memory_buffer()
        yield ProcessGroupCollection(tp=one, ep=one, expt_tp=one, tp_ep=one, expt_dp=one)
    finally:
        ps.destroy_global_memory_buffer()
        if created:
            dist.destroy_process_group()


class _ReferenceGroupedGemm:
    """grouped_gemm.ops.gmm's contract: out[group i rows] = a[group i rows] @ b[i] (trans_b=False)."""

    @staticmethod
    def gmm(a, b, batch_sizes, trans_b=False):
        assert batch_sizes.device.type == "cpu"  # grouped_gemm takes its batch sizes on the CPU
        outs, start = [], 0
        for i, m in enumerate(batch_sizes.tolist()):
            outs.append(a[start:start + m] @ (b[i].t() if trans_b else b[i]))
            start += m
        return torch.cat(outs)


@pytest.fixture
def grouped_mlp_on_cpu(monkeypatch):
    """megatron-core's legacy GroupedMLP buildable and runnable on CPU: its grouped_gemm check
    satisfied by a stand-in and gmm by the reference above (its parameters, layout and
    sharded_state_dict are megatron-core's own). Skips where megatron-core has no GroupedMLP."""
    from megatron.core.transformer.moe import experts as mexperts

    if not hasattr(mexperts, "GroupedMLP"):
        pytest.skip("this megatron-core has no legacy GroupedMLP (0.19+)")
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    monkeypatch.setattr(gg, "grouped_gemm", object())  # passes assert_grouped_gemm_is_available
    monkeypatch.setattr(gg, "ops", _ReferenceGroupedGemm)
    monkeypatch.setattr(mexperts, "jit_fuser", lambda fn: fn)  # no torch.compile of the glu on CPU
    return mexperts.GroupedMLP
