"""The trainers' hook: Checkpointer runs Megatron's --save/--load/--save-interval/--ckpt-step
in one rank's training loop; megatron_checkpointer and hetero_checkpointer build it for the
baseline and the HeterMoE trainer.
"""
from __future__ import annotations

from dataclasses import asdict

from megatron_hetermoe.checkpoint.format import RankState, read_tracker
from megatron_hetermoe.checkpoint.load import load
from megatron_hetermoe.checkpoint.local import LocalCheckpoints
from megatron_hetermoe.checkpoint.save import save
from megatron_hetermoe.config import MEGATRON_ROLE


class Checkpointer:
    """Megatron's --save/--load/--save-interval/--ckpt-step for one rank's training loop, and its
    non-persistent local checkpoints (`local`, checkpoint/local.py)."""

    def __init__(self, state: RankState, save_dir: str | None = None, load_dir: str | None = None,
                 save_interval: int | None = None, ckpt_step: int | None = None, reshard: bool = False,
                 local: LocalCheckpoints | None = None):
        if save_interval is not None and save_interval < 1:
            raise ValueError(f"--save-interval {save_interval} must be a positive number of iterations")
        self.state, self.save_dir, self.load_dir = state, save_dir, load_dir
        self.save_interval, self.ckpt_step, self.reshard = save_interval, ckpt_step, reshard
        self.last_saved: int | None = None
        self.start = 0
        self.local = local

    @classmethod
    def from_config(cls, cfg, state: RankState) -> "Checkpointer":
        local = None
        if cfg.local_ckpt is not None:  # every rank builds it here: it creates a process group
            local = LocalCheckpoints(cfg.local_ckpt, state.rank, state.world_size)
        return cls(state, cfg.save, cfg.load, cfg.save_interval, cfg.ckpt_step, cfg.ckpt_reshard, local)

    def resume(self) -> int:
        """Load if --load was given (the newer of the persistent checkpoint there and the local
        ones, as Megatron loads; --ckpt-step: that persistent one); return the iteration to
        continue from."""
        source, step = self.load_dir, self.ckpt_step
        if self.local is not None:
            persistent = read_tracker(self.load_dir) if self.load_dir else None
            found = self.local.begin(persistent, restore=bool(self.load_dir) and self.ckpt_step is None)
            if found is not None:
                source, step = found, None  # the assembled directory holds that one iteration
        if source:
            self.start = load(self.state, source, step, self.reshard)
            self.last_saved = self.start
        return self.start

    def after_step(self, iteration: int) -> None:
        if self.save_dir and self.save_interval and iteration % self.save_interval == 0:
            save(self.state, self.save_dir, iteration)
            self.last_saved = iteration
        if self.local is not None and self.local.cfg.interval and iteration % self.local.cfg.interval == 0:
            self.local.save(self.state, iteration)

    def finish(self, iteration: int) -> None:
        """Megatron saves once more at the end unless the last iteration was just saved."""
        if self.save_dir and iteration != self.last_saved and iteration > 0:
            save(self.state, self.save_dir, iteration)
            self.last_saved = iteration
        if self.local is not None:
            self.local.wait()  # the peers wait for this rank's last copy
            if self.state.rank == 0:
                print(self.local.summary(), flush=True)


def _train_dict(cfg) -> dict:
    out = {k: getattr(cfg, k) for k in ("lr", "min_lr", "lr_warmup_iters", "weight_decay", "clip_grad",
                                        "train_iters", "micro_batch_size", "global_batch_size", "seed")}
    out["precision"] = cfg.precision  # bf16/fp16 files hold Megatron's mixed-precision optimizer state
    return out


def megatron_checkpointer(cfg, module, names: dict[str, str], optimizer, scheduler) -> Checkpointer:
    """The baseline trainer's checkpointer (call after initialize_model_parallel)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    par = cfg.parallel
    layout = {"tensor-model-parallel-size": par.tp, "pipeline-model-parallel-size": par.pp,
              "expert-model-parallel-size": par.ep, "data-parallel-size": ps.get_data_parallel_world_size(),
              "use-distributed-optimizer": cfg.use_distributed_optimizer}
    state = RankState("megatron", dist.get_rank(), dist.get_world_size(), MEGATRON_ROLE, module, dict(names),
                      optimizer, scheduler, asdict(cfg.model), layout, _train_dict(cfg))
    return Checkpointer.from_config(cfg, state)


def hetero_rank_state(cfg, hs, module, names: dict[str, str], optimizer, scheduler,
                      expert_precision: str | None = None) -> RankState:
    """What a HeterMoE rank saves; the layout is the plan (schedule, GPU types and R do not change
    who holds what, so they may differ between save and load). `expert_precision`: the expert
    pool's (--hetero-expert-precision; default the world's), recorded like the world's."""
    train = _train_dict(cfg)
    train["expert_precision"] = expert_precision or cfg.precision
    return RankState("hetero", hs.rank, hs.plan.world_size, hs.role, module, dict(names), optimizer,
                     scheduler, asdict(cfg.model), {"plan": hs.plan.to_dict()}, train, group=hs.group("world"))


def hetero_checkpointer(cfg, hs, module, names: dict[str, str], optimizer, scheduler,
                        expert_precision: str | None = None) -> Checkpointer:
    """A HeterMoE rank's checkpointer (hetero_rank_state)."""
    return Checkpointer.from_config(cfg, hetero_rank_state(cfg, hs, module, names, optimizer, scheduler,
                                                           expert_precision))
