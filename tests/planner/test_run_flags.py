"""A plan made from a run's flags is the plan that run accepts (issue 42 item 1): `hetermoe plan
--even ... -- <flags>` takes TP, PP, virtual stages, EP and R = global batch / (micro batch x
attention members) from the run's flags as Megatron-LM reads them, checked here with the runtime's
own checks (training/validation.py); a search takes the run's recomputation, micro batch, TP and
PP; MTP models are searched, the pick DistEP while zebra does not run MTP; the planner's rules on
what runs agree with the runtime's refusals."""
import argparse

import pytest

from megatron_hetermoe.config import PoolPrecision
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, even_plan
from megatron_hetermoe.planner.cli_plan import main
from megatron_hetermoe.planner.cluster import Cluster
from megatron_hetermoe.planner.megatron_flags import model_from_flags
from megatron_hetermoe.planner.search import PICK, ZEBRA_NO_EA, search
from megatron_hetermoe.training.validation import (
    ConfigError,
    check_hetero_pp,
    check_hetero_tp,
    check_hetero_virtual_stages,
    check_plan_for_job,
)

SHAPE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--num-experts", "8",
         "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--vocab-size", "256", "--seq-length", "32"]


def run_accepts(plan: HeteroPlan, flags: list[str], schedule: str = "distep") -> None:
    """The checks a --hetero-plan run makes of the plan against its flags (both hostings)."""
    fm = model_from_flags(flags)
    r, m = fm.run, fm.model
    gbs = r.global_batch_size or r.micro_batch_size * plan.num_attention_members
    check_plan_for_job(plan, plan.world_size, m.num_layers, m.num_experts, r.micro_batch_size, gbs,
                       PoolPrecision("fp32", "fp32"), "the flags' model", "remake the plan",
                       moe_layer_freq=m.moe_layer_freq, mtp_num_layers=m.mtp_num_layers)
    check_hetero_tp(plan, r.tensor_model_parallel_size, r.sequence_parallel)
    check_hetero_pp(plan, r.pipeline_model_parallel_size, schedule)
    check_hetero_virtual_stages(plan, r.virtual_stages if r.virtual_stages > 1 else None, schedule)


@pytest.mark.parametrize("hetermoe, run, want", [
    # TP 2 with SP: 4 attention ranks are 2 members; R = 16 / (2 x 2)
    (["--attention-ranks", "4", "--expert-ranks", "2"],
     ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--micro-batch-size", "2", "--global-batch-size",
      "16"], dict(attention_tp=2, pipeline_stages=1, virtual_stages=1, num_microbatches=4, world_size=6)),
    # PP 2 (M, N per stage), R = 8 / (1 x 1 x 2 groups)... per group 1 member: 2 members over 2 groups
    (["--attention-ranks", "1", "--expert-ranks", "1", "--groups", "2"],
     ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"],
     dict(attention_tp=1, pipeline_stages=2, virtual_stages=1, num_microbatches=4, world_size=8)),
    # virtual stages as layers per virtual stage: 4 layers / PP 2 / 1 = 2
    (["--attention-ranks", "1", "--expert-ranks", "1"],
     ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size",
      "4"], dict(attention_tp=1, pipeline_stages=2, virtual_stages=2, num_microbatches=4, world_size=4)),
    # N from --expert-model-parallel-size; no --global-batch-size: Megatron's micro x data-parallel, R = 1
    (["--attention-ranks", "2"], ["--expert-model-parallel-size", "4", "--micro-batch-size", "3"],
     dict(attention_tp=1, pipeline_stages=1, virtual_stages=1, num_microbatches=1, world_size=6)),
])
def test_even_plan_follows_the_run_and_the_run_accepts_it(tmp_path, hetermoe, run, want):
    out = tmp_path / "p.json"
    assert main(["--even", *hetermoe, "-o", str(out), "--", *SHAPE, *run]) == 0
    plan = HeteroPlan.load(out)
    assert {k: getattr(plan, k) for k in want} == want
    run_accepts(plan, [*SHAPE, *run])


def test_the_old_plan_is_refused_by_the_run():
    """What hetermoe plan --even wrote before (TP 1, PP 1, R from --microbatches): the run refuses it,
    so the test above can fail."""
    run = [*SHAPE, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--micro-batch-size", "2",
           "--global-batch-size", "16"]
    old = even_plan(4, 8, 4, 2)
    with pytest.raises(ConfigError, match="--global-batch-size 16: must be --micro-batch-size 2 x the plan's R=1"):
        run_accepts(old, run)
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size 2: the plan's attention members"):
        check_hetero_tp(old, 2, True)
    old_batch = even_plan(4, 8, 4, 2, attention_tp=2)
    with pytest.raises(ConfigError, match="--global-batch-size 16"):
        run_accepts(old_batch, run)


def test_even_plan_conflicts_and_notes_are_named(tmp_path, capsys):
    out = str(tmp_path / "p.json")
    assert main(["--even", "--attention-ranks", "3", "--expert-ranks", "1", "-o", out, "--", *SHAPE,
                 "--global-batch-size", "8"]) == 2
    assert ("the run's --global-batch-size 8 is not a multiple of --micro-batch-size 1 x 3 attention members"
            in capsys.readouterr().err)
    assert main(["--even", "--attention-ranks", "2", "--expert-ranks", "1", "--attention-tp", "2", "-o", out, "--",
                 *SHAPE]) == 2
    assert "--attention-tp 2 and the run's --tensor-model-parallel-size 1" in capsys.readouterr().err
    assert main(["--even", "--attention-ranks", "2", "--expert-ranks", "1", "--microbatches", "3", "-o", out, "--",
                 *SHAPE, "--global-batch-size", "4"]) == 2
    assert "--microbatches 3 and the run's --global-batch-size / (--micro-batch-size x attention members) 2" in \
        capsys.readouterr().err
    assert main(["--even", "--attention-ranks", "2", "--expert-ranks", "2", "-o", out, "--", *SHAPE,
                 "--expert-model-parallel-size", "4"]) == 0
    assert "--expert-model-parallel-size 4: the plan's placement wins (as in the run)" in capsys.readouterr().err
    assert main(["--even", "--attention-ranks", "2", "--expert-ranks", "1", "-o", out, "--", *SHAPE,
                 "--tensor-model-parallel-size", "2"]) == 0
    assert "without --sequence-parallel: the run refuses it" in capsys.readouterr().err


def test_search_prices_mtp_and_picks_what_runs():
    """An MTP model is searched (it was refused): its MTP layer is a plan MoE layer after the
    decoder's; zebra runs it (models/stages.py), so the pick may be zebra; the MTP layer costs time."""
    m = model_from_flags([*SHAPE, "--mtp-num-layers", "1"]).model
    cl = Cluster.load("mini-2a40-2v100")
    res = search(m, cl, 32, 8)
    plan = res.plan
    assert (plan.num_layers, plan.mtp_layers, plan.decoder_layers) == (5, 1, 4)
    assert plan.schedule == "zebra"  # zebra beats DistEP here as without MTP
    plan.validate()
    rows = res.by_name()
    assert rows[ZEBRA_NO_EA].fits
    without = search(m.replace(mtp_num_layers=None), cl, 32, 8).by_name()
    assert rows[PICK].step_time_s > without[PICK].step_time_s * 1.05  # 5 MoE layers and 2 heads instead of 4 and 1


def test_search_takes_the_runs_recompute_and_layout(tmp_path, capsys):
    out = tmp_path / "p.json"
    base = ["--cluster", "h100x16-v100x16", "--seq-len", "4096", "--global-batch", "64", "-o", str(out), "--",
            "--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16", "--num-experts", "16",
            "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--vocab-size", "32000"]
    assert main([*base, "--recompute-granularity", "full", "--tensor-model-parallel-size", "2",
                 "--sequence-parallel", "--use-distributed-optimizer"]) == 0
    plan = HeteroPlan.load(out)
    err = capsys.readouterr()
    assert plan.schedule == "zebra" and plan.attention_tp == 2 and plan.meta["distributed_optimizer"]
    assert "train it with: --tensor-model-parallel-size 2 --sequence-parallel" in err.out
    assert main([*base, "--moe-layer-recompute", "--micro-batch-size", "1"]) == 0
    plan = HeteroPlan.load(out)
    assert plan.expert_recompute == "keep-inputs"  # what the runtime runs for it (models/experts.recomputes_experts)
    assert 64 // (plan.num_attention_members * plan.num_microbatches) == 1  # the run's micro batch
    assert main([*base, "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]) == 2
    assert "the search does not price virtual stages; make an even plan (--even)" in capsys.readouterr().err


def _megatron_args(**kw) -> argparse.Namespace:
    base = dict(mtp_num_layers=None, recompute_granularity=None, recompute_modules=None, recompute_method=None,
                recompute_num_layers=None, num_layers=4)
    return argparse.Namespace(**{**base, **kw})


def test_planner_rules_agree_with_the_runtime():
    """The pick's schedules mirror the runtime's refusals (megatron_lm/refusals.py,
    megatron_lm/replaced.py): both schedules run MTP models, only zebra full recomputation; when
    the runtime changes, this fails."""
    from megatron_hetermoe.megatron_lm.refusals import schedule_refusals
    from megatron_hetermoe.megatron_lm.replaced import recompute_choice

    for schedule in ("zebra", "distep"):
        assert not schedule_refusals(_megatron_args(mtp_num_layers=1), schedule), (
            f"the runtime refuses MTP under {schedule} again (megatron_lm/refusals.schedule_refusals): make the "
            f"search's pick (planner/search.py pick_schedules) and hetermoe plan follow it")
    full = _megatron_args(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert recompute_choice(full, "distep")[2], "DistEP runs full recomputation now: let the search pick it"
    assert not recompute_choice(full, "zebra")[2]


def test_model_from_flags_needs_no_price_for_an_even_plan(tmp_path):
    """Every flag the issue names is taken for an even plan: Qwen3's kv-channels, MLA, quick-GeGLU,
    sliding windows and sinks, MTP."""
    out = str(tmp_path / "p.json")
    for extra in (["--group-query-attention", "--num-query-groups", "2", "--kv-channels", "32", "--qk-layernorm"],
                  ["--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim",
                   "4", "--v-head-dim", "8", "--kv-channels", "16"],
                  ["--quick-geglu", "--softmax-type", "learnable", "--window-size", "8,0", "--window-attn-skip-freq",
                   "2", "--kv-channels", "8"],
                  ["--mtp-num-layers", "1", "--moe-layer-freq", "([0]+[1]*3)"]):
        flags = [f for f in SHAPE if not ("--quick-geglu" in extra and f == "--swiglu")] + extra
        assert main(["--even", "--attention-ranks", "1", "--expert-ranks", "2", "-o", out, "--", *flags]) == 0
        assert HeteroPlan.load(out).num_layers == model_from_flags(flags).model.planned_num_moe_layers
