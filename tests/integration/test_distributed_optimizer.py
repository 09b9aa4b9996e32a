"""The plugin trainer with Megatron's distributed optimizer (--use-distributed-optimizer): both
hostings now step through one RoleAssembly, whose optimizer takes the global norm over the world
with each shard counted once, so the same flag works on the plugin's trainer as inside
Megatron-LM's pretrain(). Sharding the optimizer state changes no number."""
import pytest
from margins import within
from shared_plans import asym_ea_plan, sparse_asym_ea_plan

from megatron_hetermoe.config import HeteroRunConfig, ParallelConfig, TrainConfig
from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.training.args import run

pytestmark = pytest.mark.slow
PLANS = {"2x(1+1)": lambda t: even_plan(t.num_layers, t.num_experts, 1, 1, groups=2, num_microbatches=2),
         "asym-ea 2x(1+1)": lambda t: asym_ea_plan(), "sparse asym-ea 2+2": lambda t: sparse_asym_ea_plan()}


@pytest.mark.parametrize("name", list(PLANS))
@pytest.mark.parametrize("schedule", ["distep", "zebra"])
def test_distributed_optimizer_gives_the_same_losses(tiny, name, schedule, tmp_path):
    plan = PLANS[name](tiny)
    cfg = TrainConfig(tiny, ParallelConfig(), micro_batch_size=1, global_batch_size=4, train_iters=4, quiet=True)
    hetero = HeteroRunConfig(schedule=schedule)
    plain = run(cfg, plan.world_size, plan=plan, hetero=hetero)
    sharded = run(TrainConfig(**{**cfg.__dict__, "use_distributed_optimizer": True}), plan.world_size, plan=plan,
                  hetero=hetero)
    # Measured: bitwise (the same Adam on the same gradients, its state split over the data-parallel ranks).
    within("losses, distributed vs plain optimizer", max(abs(a - b) for a, b in zip(sharded.losses, plain.losses)),
           1e-6)
