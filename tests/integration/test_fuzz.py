"""Fuzzing (hypothesis) of every user input: plan, model config, cluster and GPU profile files,
training flags, and the planner's inputs. The property everywhere: an input is either refused
with the documented error type (a ValueError subclass naming the field) or accepted, and an
accepted input is usable downstream (it builds, simulates or round-trips) without a crash.
Example counts are bounded so the file runs in well under 30 s on 2 shared cores."""
from __future__ import annotations

import atexit
import copy
import itertools
import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from megatron_hetermoe.config import (
    ModelConfig,
    ModelConfigError,
    ParallelConfig,
    TrainConfig,
)
from megatron_hetermoe.models.builder import transformer_config
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, PlanError, even_plan
from megatron_hetermoe.plan.tasks import tasks_for_rank
from megatron_hetermoe.planner import asym_ea
from megatron_hetermoe.planner.cluster import Cluster, ClusterError
from megatron_hetermoe.planner.cost_model import CostModel, TrainSettings
from megatron_hetermoe.planner.gpu_profile import ProfileError
from megatron_hetermoe.planner.profiles import known_gpu_types, load_profile
from megatron_hetermoe.planner.search import build_plan, search
from megatron_hetermoe.training.validation import ConfigError, validate_job

FAST = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
TMP = Path(tempfile.mkdtemp(prefix="hetermoe-fuzz-"))
atexit.register(shutil.rmtree, TMP, True)  # the suite leaves nothing in the temp dir
_n = itertools.count()

# JSON/YAML-like values: what a hand-edited file can hold.
scalars = (st.none() | st.booleans() | st.integers(-3, 40) | st.sampled_from([2**40, -(2**40)])
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                      max_leaves=12)


def _paths(obj, prefix=()):
    """Every path into a nested dict/list (the mutation points of a valid document)."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


@st.composite
def mutated(draw, doc):
    """`doc` with 0-3 random edits: a value replaced by anything, a number nudged (plausible
    typos, which are often still valid), a key deleted, or a key added."""
    d = copy.deepcopy(doc)
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2, 3]))):
        paths = [p for p in _paths(d) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = d
        for k in path[:-1]:
            parent = parent[k]
        op = draw(st.sampled_from(["replace", "nudge", "nudge", "delete", "add"]))
        old = parent[path[-1]]
        if op == "nudge" and type(old) in (int, float):
            parent[path[-1]] = type(old)(old + draw(st.integers(-2, 2)))
        elif op == "nudge" and isinstance(old, list) and old:
            parent[path[-1]] = old[:-1] if draw(st.booleans()) else old + old[-1:]
        elif op in ("replace", "nudge"):
            parent[path[-1]] = draw(values)
        elif op == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=6))] = draw(values)
        else:
            parent.append(draw(values))
    return d


def _write(doc, suffix=".yaml") -> Path:
    p = TMP / f"f{next(_n)}{suffix}"  # a fresh name each time: profiles are cached by path
    p.write_text(yaml.safe_dump(doc) if suffix == ".yaml" else json.dumps(doc))
    return p


# ---------------------------------------------------------------- plans
@st.composite
def valid_plans(draw):
    """Plans the way users make them: even, or searched with an Asym-EA offload k per layer."""
    L, E = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4, 8]))
    M, N, G = draw(st.integers(1, 3)), draw(st.integers(1, min(E, 3))), draw(st.integers(1, 2))
    R = draw(st.integers(1, 4))
    schedule = draw(st.sampled_from(["distep", "zebra"]))
    if draw(st.booleans()):
        return even_plan(L, E, M, N, groups=G, num_microbatches=R, schedule=schedule)
    k = [draw(st.integers(0, E)) for _ in range(L)]
    model = ModelConfig("p", L, 64, 4, 128, 128, E, 1)
    attn = list(range(M * G))
    return build_plan(model, ["cpu"] * ((M + N) * G), attn, list(range(M * G, (M + N) * G)), G, R, k, schedule)


VALID_PLAN = even_plan(2, 4, 2, 2, groups=2, num_microbatches=2, gpu_types=["A40"] * 2 + ["V100-16GB"] * 2 + ["A40"] * 2
                       + ["V100-16GB"] * 2).to_dict()


def _plan_is_usable(plan: HeteroPlan) -> None:
    again = HeteroPlan.from_dict(json.loads(plan.to_json()))
    assert again.to_dict() == plan.to_dict()
    for r in range(plan.world_size):
        assert plan.role(r) in ("attention", "expert")
        if plan.pipeline_stages == 1 or plan.schedule != "distep":  # DistEP in stages: Megatron's 1F1B, no list
            assert tasks_for_rank(plan, r)  # the schedule of every rank builds


@FAST
@given(valid_plans().flatmap(lambda p: mutated(p.to_dict())))
def test_fuzz_plan_file(doc):
    path = _write(doc, ".json")
    try:
        plan = HeteroPlan.load(path)
        plan.validate(known_gpu_types=known_gpu_types())
    except PlanError:
        event("refused")
        return
    event("accepted")
    _plan_is_usable(plan)


@FAST
@given(values)
def test_fuzz_plan_any_json(doc):
    try:
        HeteroPlan.from_dict(doc).validate()
    except PlanError:
        pass


def test_plan_file_that_is_not_json(tmp_path):
    p = tmp_path / "plan.json"
    p.write_bytes(b"\xff\xfe{")
    with pytest.raises(PlanError, match="not valid JSON"):
        HeteroPlan.load(p)


# ---------------------------------------------------------------- model configs
VALID_MODEL = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs/models/tiny.yaml").read_text())


@FAST
@given(mutated(VALID_MODEL) | values)
def test_fuzz_model_config(doc):
    try:
        m = ModelConfig.load(_write(doc))
    except ModelConfigError:
        event("refused")
        return
    event("accepted")
    # Accepted by us => accepted by megatron-core (checked with no process group).
    transformer_config(m, ParallelConfig())


# ---------------------------------------------------------------- clusters
VALID_CLUSTER = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs/clusters/o1.yaml").read_text())


@FAST
@given(mutated(VALID_CLUSTER) | values)
def test_fuzz_cluster_file(doc):
    try:
        c = Cluster.load(_write(doc))
    except ClusterError:
        event("refused")
        return
    event("accepted")
    assert c.world_size == len(c.gpu_types()) == len(c.node_of()) == len(c.nic_gbs()) >= 1
    assert all(x > 0 and math.isfinite(x) for x in c.nic_gbs())
    assert math.isfinite(c.network_latency_us) and c.network_latency_us >= 0


# ---------------------------------------------------------------- GPU profiles
PROFILE_DOCS = [yaml.safe_load(p.read_text())
                for p in sorted((Path(__file__).resolve().parents[2] / "configs/gpus").glob("*.yaml"))
                if p.stem in ("a40", "v100-16gb", "cpu")]


@FAST
@given(st.sampled_from(PROFILE_DOCS).flatmap(mutated) | values)
def test_fuzz_profile_file(doc):
    try:
        prof = load_profile(str(_write(doc)))
    except ProfileError:
        event("refused")
        return
    event("accepted")
    tiny = ModelConfig.load("tiny")
    cost = CostModel(tiny, {prof.name: prof}, TrainSettings(tiny.seq_length))
    for t in (cost.expert_time(prof.name, 64.0), cost.attention_time(prof.name, 64.0, backward=True)):
        assert math.isfinite(t) and t >= 0, (prof, t)
    assert prof.usable_memory_bytes > 0


# ---------------------------------------------------------------- training inputs
def _no_training():
    """What a stubbed trainer returns: a run of no steps."""
    from megatron_hetermoe.training.result import TrainResult

    return TrainResult(losses=[], step_times=[], start_iteration=0, num_microbatches=1, dp=1, skipped=[],
                       loss_scales=[], overflow_skipped=[], param_dtypes=[], kernels="local", kernels_reason="",
                       busy_s=[])


def _mostly(valid, invalid):
    """Valid values 4 times in 5, so whole jobs get accepted often enough to test that path."""
    return st.sampled_from([0, 1, 2, 3, 4]).flatmap(lambda i: invalid if i == 0 else valid)


@FAST
@given(mbs=_mostly(st.integers(1, 2), st.integers(-1, 0)), gbs=st.sampled_from([4, 8, 16]) | st.integers(-1, 17),
       iters=_mostly(st.integers(0, 3), st.just(-1)), lr=_mostly(st.just(1e-3), st.floats(-1, 1) | st.just(math.nan)),
       min_lr=_mostly(st.just(1e-4), st.floats(-1, 1)),
       clip=_mostly(st.floats(0, 2), st.just(math.inf) | st.just(-1.0)),
       seed=_mostly(st.integers(0, 2**32 - 1), st.sampled_from([-1, 2**32, 2**40])),
       ep=_mostly(st.sampled_from([1, 2, 4]), st.integers(0, 5)), pp=st.integers(1, 3), world=st.integers(1, 9))
def test_fuzz_baseline_job(mbs, gbs, iters, lr, min_lr, clip, seed, ep, pp, world):
    tiny = ModelConfig.load("tiny")
    cfg = TrainConfig(tiny, ParallelConfig(pp=pp, ep=ep), micro_batch_size=mbs, global_batch_size=gbs,
                      train_iters=iters, lr=lr, min_lr=min_lr, clip_grad=clip, seed=seed)
    try:
        validate_job(cfg, world)
    except ConfigError:
        event("refused")
        return
    event("accepted")
    # Accepted: the layout Megatron will build divides as it requires.
    assert world % (pp * ep) == 0 and tiny.num_experts % ep == 0 and tiny.num_layers % pp == 0
    assert gbs % (mbs * world // pp) == 0 and 0 <= min_lr <= lr


@FAST
@given(mutated(VALID_PLAN), st.integers(1, 4), st.just(8) | st.integers(1, 33), st.just(8) | st.integers(1, 9))
def test_fuzz_hetero_job(doc, mbs, gbs, world):
    tiny = ModelConfig.load("tiny")
    cfg = TrainConfig(tiny, micro_batch_size=mbs, global_batch_size=gbs, train_iters=1)
    try:
        plan = HeteroPlan.from_dict(doc)
        validate_job(cfg, world, plan=plan)
    except (ConfigError, PlanError):
        event("refused")
        return
    event("accepted")
    assert plan.world_size == world and plan.num_layers == tiny.num_layers
    assert gbs == mbs * plan.num_microbatches * len(plan.attention_ranks)
    _plan_is_usable(plan)


# ---------------------------------------------------------------- planner
GPU_PAIRS = [("A40", "V100-16GB"), ("H100", "A100-80GB"), ("cpu", "cpu")]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(pair=st.sampled_from(GPU_PAIRS), a=st.integers(1, 4), x=st.integers(0, 4), per_node=st.integers(1, 4),
       layers=st.integers(1, 4), experts=st.sampled_from([1, 2, 4, 8]), topk=st.integers(1, 2),
       hidden=st.sampled_from([64, 512, 4096]), seq=st.sampled_from([1, 7, 512, 16384]), gb=st.integers(1, 16),
       asym=st.sampled_from(["optimal", "greedy", "none"]), engine=st.sampled_from(["python", "cpp"]))
def test_fuzz_planner_search(pair, a, x, per_node, layers, experts, topk, hidden, seq, gb, asym, engine):
    model = ModelConfig("fuzz", layers, hidden, max(1, hidden // 128), 4 * hidden, 4 * hidden, experts,
                        min(topk, experts), vocab_size=1000, seq_length=seq)
    counts = {pair[0]: a + x} if pair[0] == pair[1] else {pair[0]: a, **({pair[1]: x} if x else {})}
    cluster = Cluster.of("fuzz", counts, gpus_per_node=per_node)
    try:
        res = search(model, cluster, seq, gb, asym=asym, engine=engine, max_microbatches=8)
    except PlanError:
        event("refused")
        return
    event("plan" if res.plan is not None else "no plan fits")
    for p in res.predictions:
        assert not math.isnan(p.step_time_s) and (p.fits == math.isfinite(p.step_time_s)), p
    if res.plan is not None:
        res.plan.validate(world_size=cluster.world_size, known_gpu_types=known_gpu_types())
        assert res.plan.num_layers == layers and res.plan.num_experts == experts
        _plan_is_usable(res.plan)


@FAST
@given(L=st.integers(1, 6), E=st.integers(1, 16), M=st.integers(1, 4), N=st.integers(1, 4),
       t=st.lists(st.floats(0, 10), min_size=6, max_size=6), te=st.floats(0, 10), tx=st.floats(0, 10),
       n_max=st.integers(-1, 40), cap=st.integers(0, 60))
def test_fuzz_asym_ea(L, E, M, N, t, te, tx, n_max, cap):
    prob = asym_ea.AsymProblem(L, E, M, N, tuple(t[:L]), te, tx, n_max, cap)
    for solver in (asym_ea.optimal, asym_ea.gather_squeeze):
        try:
            k = solver(prob)
        except PlanError:
            event(f"{solver.__name__} refused")
            continue
        event(f"{solver.__name__} solved")
        assert len(k) == L and all(0 <= v <= E for v in k) and asym_ea.memory_ok(prob, k), (solver, k)
        for pl in asym_ea.placement(k, E, list(range(M)), list(range(M, M + N))):
            assert sorted(e for es in pl.values() for e in es) == list(range(E))


# ---------------------------------------------------------------- hetermoe train's command line
TRAIN_FLAGS = ["--micro-batch-size", "--global-batch-size", "--train-iters", "--lr", "--min-lr", "--seed",
               "--clip-grad", "--expert-model-parallel-size", "--pipeline-model-parallel-size", "--nproc",
               "--seq-length", "--moe-aux-loss-coeff", "--log-interval", "--lr-warmup-iters", "--weight-decay"]


@FAST
@given(st.lists(st.tuples(st.sampled_from(TRAIN_FLAGS),
                          st.sampled_from(["0", "1", "2", "4", "8", "-1", "0.5", "nan", "inf", "x", "1e9"])),
                max_size=5))
def test_fuzz_train_command_line(pairs):
    """`hetermoe train ARGV` either exits with a usage error before any launch, or launches a
    job that validate_job accepts (the launch itself is replaced by a recorder here)."""
    from megatron_hetermoe.training import args as train_args

    launched = []
    real_run = train_args.run
    train_args.run = lambda cfg, nproc, **kw: launched.append((cfg, nproc)) or _no_training()
    try:
        train_args.main([x for pair in pairs for x in pair])
    except SystemExit as e:
        event("refused")
        assert e.code not in (0, None) and not launched
        return
    finally:
        train_args.run = real_run
    event("launched")
    (cfg, nproc), = launched
    validate_job(cfg, nproc)
