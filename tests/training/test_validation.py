"""Every user input error: refused before any process group exists, with a message that names
the field, the bad value and the fix; and docs/reliability.md's table lists each one with its message.

CASES is the single list: (input, field, how to provoke it, expected error type, the message's
start after file paths are replaced by PATH). test_error_table_lists_every_error checks the rows of
docs/reliability.md's "Input errors" table against it (the table lived in README.md before).
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml

from megatron_hetermoe.config import ModelConfig, ModelConfigError
from megatron_hetermoe.outputs import OutputPathError
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, PlanError, even_plan
from megatron_hetermoe.planner.cluster import Cluster, ClusterError
from megatron_hetermoe.planner.gpu_profile import ProfileError
from megatron_hetermoe.planner.profiles import load_profile
from megatron_hetermoe.training import args as train_args
from megatron_hetermoe.training.validation import ConfigError

ROOT = Path(__file__).resolve().parents[2]
ERROR_TABLE = ROOT / "docs" / "reliability.md"  # its "## Input errors" section
TINY = yaml.safe_load((ROOT / "configs/models/tiny.yaml").read_text())
O1 = yaml.safe_load((ROOT / "configs/clusters/o1.yaml").read_text())
A40 = yaml.safe_load((ROOT / "configs/gpus/a40.yaml").read_text())
PLAN = even_plan(2, 4, 1, 2, num_microbatches=2).to_dict()


def edit(doc: dict, **changes) -> dict:
    """A copy of `doc` with top-level changes (value None deletes the key)."""
    d = copy.deepcopy(doc)
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


def _file(tmp: Path, doc, suffix: str) -> Path:
    p = tmp / f"input{len(list(tmp.iterdir()))}{suffix}"
    p.write_text(doc if isinstance(doc, str) else (json.dumps(doc) if suffix == ".json" else yaml.safe_dump(doc)))
    return p


def flags(*argv: str, plan: dict | None = None):
    """`hetermoe train ARGV` (with --hetero-plan written from `plan`); returns its error text."""

    def go(tmp: Path) -> None:
        args = list(argv)
        if plan is not None:
            args += ["--hetero-plan", str(_file(tmp, plan, ".json"))]
        train_args.main(args)

    return go


def model(doc) -> callable:
    return lambda tmp: ModelConfig.load(_file(tmp, doc, ".yaml"))


def plan(doc) -> callable:
    return lambda tmp: HeteroPlan.load(_file(tmp, doc, ".json")).validate(world_size=3, known_gpu_types=["A40", "cpu"])


def cluster(doc) -> callable:
    return lambda tmp: Cluster.load(_file(tmp, doc, ".yaml"))


def profile(doc) -> callable:
    return lambda tmp: load_profile(str(_file(tmp, doc, ".yaml")))


def _placement(moved: dict) -> dict:
    d = copy.deepcopy(PLAN)
    d["groups"][0]["placement"][0] = moved
    return d


CASES = [
    # ---- training flags (hetermoe train), checked by validation.validate_job
    ("flags", "--micro-batch-size", flags("--micro-batch-size", "0"), ConfigError,
     "--micro-batch-size 0: must be an integer >= 1; pass --micro-batch-size 1 or more"),
    ("flags", "--global-batch-size", flags("--nproc", "4", "--global-batch-size", "6"), ConfigError,
     "--global-batch-size 6: is not divisible by --micro-batch-size 2 x data-parallel size 4; pass a multiple of 8"),
    ("flags", "--train-iters", flags("--train-iters", "-1"), ConfigError,
     "--train-iters -1: must be an integer >= 0; pass --train-iters 1 or more"),
    ("flags", "--lr-warmup-iters", flags("--train-iters", "5", "--lr-warmup-iters", "5"), ConfigError,
     "--lr-warmup-iters 5: must be below --train-iters 5 (warm-up, then cosine decay); "
     "pass --lr-warmup-iters at most 4"),
    ("flags", "--lr", flags("--lr", "nan"), ConfigError,
     "--lr nan: must be a finite number >= 0; pass e.g. --lr 0.01"),
    ("flags", "--min-lr", flags("--lr", "0.001", "--min-lr", "0.01"), ConfigError,
     "--min-lr 0.01: is above --lr 0.001; pass --min-lr at most 0.001"),
    ("flags", "--clip-grad", flags("--clip-grad", "-1"), ConfigError,
     "--clip-grad -1.0: must be a finite number >= 0; pass e.g. --clip-grad 0.01"),
    ("flags", "--seed", flags("--seed", "-5"), ConfigError,
     "--seed -5: must be an integer in [0, 4294967296); pass e.g. --seed 1234"),
    ("flags", "--save-interval", flags("--save", "/tmp/ckpt", "--save-interval", "0"), ConfigError,
     "--save-interval 0: must be an integer >= 1; pass --save-interval 1 or more"),
    ("flags", "--nproc / --expert-model-parallel-size", flags("--nproc", "3", "--expert-model-parallel-size", "2"),
     ConfigError, "world size 3 is not divisible by EP 2 x PP 1 (Megatron's expert layout); launch a multiple of 2 "
                  "ranks or change --expert-model-parallel-size"),
    ("flags", "--expert-model-parallel-size", flags("--nproc", "3", "--expert-model-parallel-size", "3"), ConfigError,
     "--expert-model-parallel-size 3: does not divide num_experts=4 of model 'tiny'; pick an expert-parallel size "
     "that divides the expert count"),
    ("flags", "--pipeline-model-parallel-size", flags("--nproc", "3", "--pipeline-model-parallel-size", "3"),
     ConfigError, "--pipeline-model-parallel-size 3: does not divide num_layers=2 of model 'tiny'; pick a pipeline "
                  "size that divides the layer count"),
    ("flags", "--tensor-model-parallel-size", flags("--tensor-model-parallel-size", "2"), ValueError,
     "--tensor-model-parallel-size 2 without --sequence-parallel: When using MoE and tensor parallelism, sequence "
     "parallelism must be used (Megatron-LM's rule); add --sequence-parallel"),
    ("flags", "--seq-length", flags("--seq-length", "0"), ModelConfigError,
     "model 'tiny': seq_length=0 must be a positive integer"),
    ("flags", "--model", flags("--model", "nosuch"), FileNotFoundError,
     "models config 'nosuch' not found: give a path to a YAML file or one of"),
    ("flags", "--global-batch-size with --hetero-plan", flags("--global-batch-size", "8", plan=PLAN), ConfigError,
     "--global-batch-size 8: must be --micro-batch-size 2 x the plan's R=2 microbatches x 1 attention ranks; pass "
     "--global-batch-size 4, or remake the plan with another --microbatches"),
    ("flags", "--model with --hetero-plan", flags("--global-batch-size", "4", plan=edit(PLAN, num_layers=1) | {
        "groups": [dict(PLAN["groups"][0], placement=PLAN["groups"][0]["placement"][:1])]}), PlanError,
     "plan is for 1 layers x 4 experts but model 'tiny' has 2 layers x 4 experts; make the plan with --model tiny"),
    ("flags", "--nproc with --hetero-plan", flags("--nproc", "2", plan=PLAN), SystemExit,
     "--nproc 2 but the plan has 3 ranks; drop --nproc"),
    ("flags", "--expert-model-parallel-size with --hetero-plan",
     flags("--expert-model-parallel-size", "2", plan=PLAN), ConfigError,
     "--expert-model-parallel-size 2 with --hetero-plan: the plan places the experts; leave "
     "--expert-model-parallel-size at 1"),
    ("flags", "--pipeline-model-parallel-size with --hetero-plan",
     flags("--pipeline-model-parallel-size", "2", plan=PLAN), ConfigError,
     "--pipeline-model-parallel-size 2: the plan has pipeline_stages=1; pass --pipeline-model-parallel-size 1, or "
     "remake the plan with 2 stages"),
    ("flags", "--hetero-plan", flags("--hetero-plan", "/no/such/plan.json"), FileNotFoundError,
     "--hetero-plan: [Errno 2] No such file or directory"),
    ("flags", "--bf16 with --fp16", flags("--bf16", "--fp16"), SystemExit,
     "argument --fp16: not allowed with argument --bf16"),
    ("flags", "--bf16 with --hetero-plan", flags("--bf16", plan=edit(PLAN, gpu_types=["A40", "V100-32GB", "T4"])),
     ConfigError, "--bf16: the plan has GPU type(s) without native bf16 (profile bf16: false): V100-32GB (ranks [1]); "
                  "T4 (ranks [2]); use --fp16"),
    ("flags", "--hetero-expert-precision", flags("--bf16", "--hetero-expert-precision", "fp32", plan=PLAN),
     ConfigError, "--hetero-expert-precision fp32 with --bf16 (attention ranks bf16): pools of different precision "
                  "must both be 16-bit"),
    ("flags", "--hetero-expert-precision bf16",
     flags("--fp16", "--hetero-expert-precision", "bf16", plan=edit(PLAN, gpu_types=["A40", "V100-32GB", "T4"])),
     ConfigError, "--hetero-expert-precision bf16: the plan's expert pool has GPU type(s) without native bf16 "
                  "(profile bf16: false): V100-32GB (ranks [1]); T4 (ranks [2]); use --hetero-expert-precision fp16"),
    ("flags", "--loss-scale", flags("--loss-scale", "128"), ConfigError,
     "--loss-scale 128.0: scales the loss of --fp16/--bf16 runs only (fp32 has none); drop --loss-scale, or add "
     "--fp16 or --bf16"),
    ("flags", "--min-loss-scale", flags("--fp16", "--initial-loss-scale", "4", "--min-loss-scale", "8"), ConfigError,
     "--min-loss-scale 8.0: is above --initial-loss-scale 4.0; pass --min-loss-scale at most 4.0"),
    ("flags", "--hysteresis", flags("--fp16", "--hysteresis", "0"), ConfigError,
     "--hysteresis 0: must be an integer >= 1; pass e.g. --hysteresis 2"),
    ("flags", "--hetero-ckpt-reshard with --bf16", flags("--bf16", "--load", "/tmp/ckpt", "--hetero-ckpt-reshard"),
     ConfigError, "--hetero-ckpt-reshard with --bf16: resharding by name moves fp32 parameters and Adam moments"),
    ("flags", "--emulate with --bf16", flags("--bf16", "--emulate", "mini-2a40-2v100"), ConfigError,
     "--bf16 with --emulate: emulated runs time fp32 work on CPU ranks (the emulated cluster is priced by the cost "
     "model); drop --bf16"),
    ("flags", "--nproc", flags("--nproc", "0"), SystemExit,
     "--nproc 0: start 1 to 1024 CPU ranks (or drop --nproc under torchrun)"),
    ("flags", "--ckpt-step without --load", flags("--ckpt-step", "2"), SystemExit,
     "--ckpt-step 2 needs --load DIR: it picks the iteration to load from DIR"),
    ("flags", "--global-batch-size (size)", flags("--global-batch-size", "1000000000000000"), ConfigError,
     "--global-batch-size 1000000000000000: is above 16777216 sequences per step, more than any cluster could hold "
     "(megatron_hetermoe/limits.py); check the value"),
    ("flags", "--save", flags("--save", "/proc/version"), OutputPathError,
     "--save /proc/version: is a file, not a directory; give a directory (it is created if missing)"),
    ("flags", "--golden-values-out", flags("--golden-values-out", "/no/such/dir/g.json"), OutputPathError,
     "--golden-values-out PATH: the directory /no/such/dir does not exist; create it first or give "
     "another path"),
    # ---- model config YAML (configs/models/, --model)
    ("model config", "(file)", model("- a list\n"), ModelConfigError,
     "PATH: a model config is a YAML mapping of fields, got list"),
    ("model config", "(field names)", model(edit(TINY, hidden=64)), ModelConfigError,
     "PATH: unknown model field(s) ['hidden']; known:"),
    ("model config", "(required fields)", model(edit(TINY, num_experts=None)), ModelConfigError,
     "PATH: missing model field(s) ['num_experts']"),
    ("model config", "num_layers (any size)", model(edit(TINY, num_layers=True)), ModelConfigError,
     "PATH: model 'tiny': num_layers=True must be a positive integer"),
    ("model config", "num_layers / num_experts / ... (size)", model(edit(TINY, num_layers=10**20)), ModelConfigError,
     "PATH: model 'tiny': num_layers=100000000000000000000 is above 4096, the largest this plugin takes "
     "(megatron_hetermoe/limits.py); check the value"),
    ("model config", "num_attention_heads", model(edit(TINY, num_attention_heads=5)), ModelConfigError,
     "PATH: model 'tiny': hidden_size=64 is not divisible by num_attention_heads=5; pick a head count that divides it"),
    ("model config", "hidden_size / num_attention_heads", model(edit(TINY, hidden_size=12)), ModelConfigError,
     "PATH: model 'tiny': head dim hidden_size/num_attention_heads = 12/4 = 3 is odd; RoPE needs an even head dim"),
    ("model config", "moe_router_topk", model(edit(TINY, moe_router_topk=5)), ModelConfigError,
     "PATH: model 'tiny': moe_router_topk=5 must be in [1, num_experts=4]"),
    ("model config", "moe_aux_loss_coeff", model(edit(TINY, moe_aux_loss_coeff=-0.1)), ModelConfigError,
     "PATH: model 'tiny': moe_aux_loss_coeff=-0.1 must be a finite number >= 0"),
    ("model config", "moe_router_load_balancing_type",
     model(edit(TINY, moe_router_load_balancing_type="global_aux_loss")), ModelConfigError,
     "PATH: model 'tiny': moe_router_load_balancing_type='global_aux_loss' is not supported"),
    ("model config", "moe_router_enable_expert_bias", model(edit(TINY, moe_router_enable_expert_bias=True)),
     ModelConfigError, "PATH: model 'tiny': moe_router_enable_expert_bias with moe_router_score_function='softmax': "
     "Megatron takes the expert bias with sigmoid scores only; set moe_router_score_function: sigmoid"),
    # ---- plan JSON (--hetero-plan, hetermoe plan -o)
    ("plan", "(file)", plan("{not json"), PlanError, "PATH: not valid JSON"),
    ("plan", "(field names)", plan(edit(PLAN, ranks=3)), PlanError, "plan has unknown field(s) ['ranks']; known:"),
    ("plan", "(required fields)", plan(edit(PLAN, groups=None)), PlanError, "plan is missing the field 'groups'"),
    ("plan", "version", plan(edit(PLAN, version=2)), PlanError,
     "plan version 2 is not supported; this build reads version 1"),
    ("plan", "version (type)", plan(edit(PLAN, version="1")), PlanError,
     'plan version \'1\' (a str) is not supported; this build reads version 1, the integer ("version": 1)'),
    ("plan", "(size)", plan(edit(PLAN, num_layers=5000)), PlanError,
     "plan num_layers=5000 is above 4096, the most any cluster could hold (megatron_hetermoe/limits.py); check the "
     "value"),
    ("plan", "schedule", plan(edit(PLAN, schedule="1f1b")), PlanError,
     "plan schedule '1f1b' is unknown; use one of ['distep', 'zebra']"),
    ("plan", "num_layers / num_experts / num_microbatches", plan(edit(PLAN, num_microbatches=0)), PlanError,
     "plan num_microbatches=0 must be a positive integer"),
    ("plan", "gpu_types", plan(edit(PLAN, gpu_types="A40")), PlanError,
     "plan gpu_types='A40' must be a list of GPU type names, one per rank"),
    ("plan", "gpu_types[rank]", plan(edit(PLAN, gpu_types=["cpu", "Z100", "cpu"])), PlanError,
     "rank 1 has unknown GPU type 'Z100'; known types:"),
    ("plan", "gpu_types (length)", lambda tmp: HeteroPlan.load(_file(tmp, PLAN, ".json")).validate(world_size=4),
     PlanError, "plan is for 3 ranks (len(gpu_types)) but the job has world size 4; launch 3 processes or make a "
                "plan for 4"),
    ("plan", "groups", plan(edit(PLAN, groups=[])), PlanError,
     "plan has no ZP groups; add at least one group with attention and expert ranks"),
    ("plan", "groups[g]", plan(edit(PLAN, groups=[{"attention_ranks": [0]}])), PlanError,
     "ZP group 0 is malformed (KeyError: 'expert_ranks'); it needs attention_ranks, expert_ranks and placement"),
    ("plan", "groups[g].attention_ranks", plan(edit(PLAN, groups=[dict(PLAN["groups"][0], attention_ranks=[])])),
     PlanError, "ZP group 0 has no attention ranks; give it at least one"),
    ("plan", "groups[g].*_ranks (range)", plan(edit(PLAN, groups=[dict(PLAN["groups"][0], expert_ranks=[1, 7])])),
     PlanError, "ZP group 0 names expert rank 7, outside 0..2 (world size = len(gpu_types) = 3)"),
    ("plan", "groups[g].*_ranks (twice)", plan(edit(PLAN, groups=[dict(PLAN["groups"][0], expert_ranks=[0, 2])])),
     PlanError, "rank 0 is both attention rank of ZP group 0 and expert rank of ZP group 0; each rank has exactly "
                "one role"),
    ("plan", "groups[g].*_ranks (missing)", plan(edit(PLAN, groups=[dict(PLAN["groups"][0], expert_ranks=[1])])),
     PlanError, "plan has 3 ranks but ranks [2] are in no ZP group; assign them a role or shrink gpu_types"),
    ("plan", "groups[g].placement (length)",
     plan(edit(PLAN, groups=[dict(PLAN["groups"][0], placement=PLAN["groups"][0]["placement"][:1])])), PlanError,
     "ZP group 0 places experts for 1 layers but the plan has num_layers=2; give one placement per MoE layer"),
    ("plan", "groups[g].placement[l] (rank)", plan(_placement({"1": [0, 1], "2": [2], "5": [3]})), PlanError,
     "layer 0 of ZP group 0 places experts [3] on rank 5, which is not a member of that group [0, 1, 2]"),
    ("plan", "groups[g].placement[l] (expert id)", plan(_placement({"1": [0, 1], "2": [2, 9]})), PlanError,
     "layer 0 of ZP group 0: expert id 9 on rank 2 is outside 0..3"),
    ("plan", "groups[g].placement[l] (twice)", plan(_placement({"1": [0, 1], "2": [1, 2, 3]})), PlanError,
     "layer 0 of ZP group 0: expert(s) [1] placed more than once; place each expert on exactly one rank"),
    ("plan", "groups[g].placement[l] (missing)", plan(_placement({"1": [0, 1], "2": [2]})), PlanError,
     "layer 0 of ZP group 0: expert(s) [3] placed on no rank; place each expert on exactly one rank"),
    ("plan", "groups[g].placement (groups differ)",
     lambda tmp: HeteroPlan.load(_file(tmp, _two_groups_differ(), ".json")).validate(), PlanError,
     "layer 0: member 1 of ZP group 1 (rank 4) holds experts [0] but member 1 of group 0 (rank 1) holds [0, 1]; "
     "every group must place experts alike so replicas line up"),
    ("plan", "(shape of groups)", lambda tmp: HeteroPlan.load(_file(tmp, _uneven_groups(), ".json")).validate(),
     PlanError, "ZP group 1 is 1:1 but group 0 is 1:2; all ZP groups must have the same M:N shape"),
    # ---- cluster YAML (hetermoe plan --cluster)
    ("cluster", "(file)", cluster("just text"), ClusterError,
     "PATH: a cluster is a YAML mapping with a non-empty node_groups list (see configs/clusters/o1.yaml)"),
    ("cluster", "node_groups[i]", cluster(edit(O1, node_groups=[{"gpu": "A40"}])), ClusterError,
     "PATH: node_groups entries need gpu, nodes, gpus_per_node, nic_gbps_per_gpu (KeyError: 'nodes')"),
    ("cluster", "node_groups[i].gpu", cluster(edit(O1, node_groups=[dict(O1["node_groups"][0], gpu="Z100")])),
     ClusterError, "PATH: node group gpu='Z100' has no profile; use one of"),
    ("cluster", "node_groups[i].nodes / gpus_per_node", cluster(edit(O1, node_groups=[dict(O1["node_groups"][0],
                                                                                            nodes=0)])),
     ClusterError, "PATH: node group 'A40': nodes=0 must be an integer >= 1"),
    ("cluster", "node_groups[i].nic_gbps_per_gpu",
     cluster(edit(O1, node_groups=[dict(O1["node_groups"][0], nic_gbps_per_gpu=0)])), ClusterError,
     "PATH: nic_gbps_per_gpu=0 must be a finite number > 0"),
    ("cluster", "network_latency_us", cluster(edit(O1, network_latency_us=-1)), ClusterError,
     "PATH: network_latency_us=-1 must be a finite number >= 0"),
    ("cluster", "(size)", cluster(edit(O1, node_groups=[dict(O1["node_groups"][0], nodes=10**9)])), ClusterError,
     "PATH: 6000000000 GPUs in all; at most 131072 are supported (check nodes)"),
    # ---- GPU profile YAML (configs/gpus/, hetermoe profile)
    ("GPU profile", "(file)", profile("[1, 2]"), ProfileError,
     "PATH: a GPU profile is a YAML mapping of fields, got list"),
    ("GPU profile", "(required fields)", profile(edit(A40, memory_gib=None)), ProfileError,
     "PATH: missing field(s) ['memory_gib']; give each as {value, source}"),
    ("GPU profile", "numeric field form", profile(edit(A40, memory_gib=48)), ProfileError,
     "PATH: field 'memory_gib' must be {value: NUMBER, source: 'TAG: note'}, got 48"),
    ("GPU profile", "*.source", profile(edit(A40, memory_gib={"value": 48, "source": "guess"})), ProfileError,
     "PATH: source of 'memory_gib' is 'guess'; start it with one of ('datasheet', 'paper-ratio', 'measured', "
     "'estimate') and a colon"),
    ("GPU profile", "*.value", profile(edit(A40, link_latency_us={"value": "fast", "source": "estimate: x"})),
     ProfileError, "PATH: value of 'link_latency_us' is 'fast', not a number"),
    ("GPU profile", "*.value (range)", profile(edit(A40, launch_overhead_us={"value": float("inf"),
                                                                              "source": "estimate: x"})),
     ProfileError, "PATH: value of 'launch_overhead_us' is inf, must be a finite number >= 0"),
    ("GPU profile", "memory_gib / peak_fp16_tflops / memory_bandwidth_gbs / intra_node_gbs",
     profile(edit(A40, peak_fp16_tflops={"value": 0, "source": "estimate: x"})), ProfileError,
     "PATH: value of 'peak_fp16_tflops' is 0; it must be > 0"),
    ("GPU profile", "*_efficiency / usable_memory_fraction",
     profile(edit(A40, gemm_efficiency={"value": 55, "source": "estimate: x"})), ProfileError,
     "PATH: value of 'gemm_efficiency' is 55.0; a fraction must be in (0, 1]"),
    ("GPU profile", "fp16 / bf16 / flash_attention", profile(edit(A40, bf16="yes")), ProfileError,
     "PATH: field 'bf16' must be true or false, got 'yes'"),
    ("GPU profile", "*_speed_vs.gpu", profile(edit(A40, gemm_efficiency=None, expert_speed_vs={
        "gpu": "Z100", "ratio": 1.2, "source": "paper-ratio: x"})), ProfileError,
     "gpus config 'Z100' not found: give a path to a YAML file or one of"),
    ("GPU profile", "*_speed_vs.ratio", profile(edit(A40, name="X40", gemm_efficiency=None, expert_speed_vs={
        "gpu": "V100-16GB", "ratio": 0, "source": "paper-ratio: x"})), ProfileError,
     "PATH: expert_speed_vs.ratio=0 must be a finite number > 0"),
    ("GPU profile", "measured", profile(edit(A40, measured={"model": {}, "attention": [{"seq_len": 1}], "expert": []})),
     ProfileError, "PATH: malformed measured table (KeyError: 'tokens'); regenerate it with `hetermoe profile`"),
]


def _two_groups_differ() -> dict:
    d = even_plan(2, 4, 1, 2, groups=2).to_dict()
    d["groups"][1]["placement"][0] = {"4": [0], "5": [1, 2, 3]}
    return d


def _uneven_groups() -> dict:
    d = even_plan(2, 4, 1, 2).to_dict()
    d["gpu_types"] += ["cpu", "cpu"]
    d["groups"].append({"attention_ranks": [3], "expert_ranks": [4], "placement": [{"4": [0, 1, 2, 3]}] * 2})
    return d


def normalize(msg: str) -> str:
    return re.sub(r"(?:^|(?<=\s))/[^\s:'\"]+\.(?:json|yaml)", "PATH", msg)


def provoke(build, tmp_path, capsys) -> tuple[BaseException, str]:
    try:
        build(tmp_path)
    except SystemExit as e:  # hetermoe train: argparse error (code 2) or a SystemExit message
        err = capsys.readouterr().err.strip().splitlines()
        text = err[-1].removeprefix("hetermoe train: error: ") if err else str(e.code)
        return e, text if e.code == 2 else str(e.code)
    except Exception as e:  # noqa: BLE001 - the type is what is checked
        return e, str(e)
    raise AssertionError("no error raised")


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """A refused job must never reach a launch or a process group."""
    def boom(*a, **k):
        raise AssertionError("the job was launched: validation missed the input")

    monkeypatch.setattr(train_args, "run", boom)
    monkeypatch.setattr(dist, "init_process_group", boom)
    yield
    assert not dist.is_initialized()


@pytest.mark.parametrize("inp, field, build, etype, message", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_error_names_field_value_and_fix(inp, field, build, etype, message, tmp_path, capsys):
    err, text = provoke(build, tmp_path, capsys)
    if inp == "flags":
        # hetermoe train turns every input error into a usage error (exit 2) before any launch
        assert isinstance(err, SystemExit), (err, text)
        if etype is not SystemExit:
            assert err.code == 2, text
    else:
        assert isinstance(err, etype), (type(err), text)
        assert isinstance(err, ValueError), "input errors are ValueError subclasses"
    assert normalize(text).startswith(message), f"\n got: {normalize(text)}\nwant: {message}"


def test_flag_errors_come_from_the_documented_types():
    # The same inputs through the library entry point keep their types (not only SystemExit).
    from megatron_hetermoe.config import ParallelConfig, TrainConfig
    from megatron_hetermoe.training.validation import validate_job

    tiny = ModelConfig.load("tiny")
    with pytest.raises(ConfigError, match="--micro-batch-size 0"):
        validate_job(TrainConfig(tiny, micro_batch_size=0), 4)
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 3"):
        validate_job(TrainConfig(tiny, ParallelConfig(ep=3), global_batch_size=6), 3)
    with pytest.raises(PlanError, match="world size 4"):
        validate_job(TrainConfig(tiny, global_batch_size=4), 4, plan=HeteroPlan.from_dict(PLAN))
    validate_job(TrainConfig(tiny, global_batch_size=4), 3, plan=HeteroPlan.from_dict(PLAN))  # the valid one


def _error_table_rows() -> list[list[str]]:
    text = ERROR_TABLE.read_text()
    start = text.index("## Input errors")
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("## "):
            break
        if line.startswith("| ") and not line.startswith("| input") and not line.startswith("| ---"):
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows


def test_error_table_lists_every_error():
    rows = _error_table_rows()
    want = [(inp, field, message, etype.__name__) for inp, field, _, etype, message in CASES]
    got = []
    for r in rows:
        m = re.fullmatch(r"(`+) ?(.*?) ?\1 \((\w+)\)", r[2])
        assert m, f"{ERROR_TABLE.name} row's message cell is not `MESSAGE` (Type): {r}"
        got.append((r[0], r[1].strip("`"), m.group(2), m.group(3)))
    assert got == want, ("docs/reliability.md's input error table is out of date "
                         "(see CASES in tests/training/test_validation.py)")
    assert all(len(r) == 4 and r[3] for r in rows), "every row needs a fix column"


def test_parity_command_refuses_bad_inputs_before_any_rank(tmp_path, capsys):
    from megatron_hetermoe.tools import parity

    path = tmp_path / "plan.json"
    even_plan(3, 4, 1, 1).save(path)
    for argv, message in ((["--plan", str(path)],
                           "plan is for 3 layers x 4 experts but model 'tiny' has 2 layers x 4 experts"),
                          (["--plan", str(path), "--steps", "0"], "--steps 0 and --micro-batch-size 2 must be")):
        with pytest.raises(SystemExit) as e:
            parity.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_an_uneven_split_is_the_plans():
    """--decoder-first/last-pipeline-num-layers against the plan's first/last_stage_layers (Megatron-LM's
    pretrain()); the plugin's trainer splits stages evenly and refuses an uneven plan by name."""
    from megatron_hetermoe.plan.hetero_plan import even_plan
    from megatron_hetermoe.training.validation import check_hetero_split

    plan = even_plan(4, 4, 1, 1, pipeline_stages=2, first_stage_layers=1)
    check_hetero_split(plan, 1, None)
    with pytest.raises(ConfigError, match=r"no uneven split flags: the plan splits its stages as "
                                          r"--decoder-first-pipeline-num-layers 1 \(stage layers \[1, 3\]\)"):
        check_hetero_split(plan, None, None)
    with pytest.raises(ConfigError, match="--decoder-last-pipeline-num-layers 2: the plan splits"):
        check_hetero_split(even_plan(4, 4, 1, 1, pipeline_stages=2), None, 2)
