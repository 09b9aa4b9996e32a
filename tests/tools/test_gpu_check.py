"""scripts/gpu_check.sh: the one-GPU check with four NCCL ranks (issue 43). Its --dry-run runs the
same harness with gloo ranks (CI's only run of it); the judgements, the per-rank wrapper, the step
selection, the timeout's clean-up and `make gpu-wheels` are checked here without a GPU. The check
is a harness beside the package (scripts/gpu_check/), not in it."""
import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "scripts" / "gpu_check"
HARNESS_MODULES = ("judge", "runner", "rank", "steps", "legacy", "workers", "probes", "main", "forkrun")


@pytest.fixture
def harness():
    """The harness's modules (they import each other by plain names), taken out again after."""
    sys.path.insert(0, str(HARNESS))
    before = set(sys.modules)
    try:
        import main

        yield main
    finally:
        sys.path.remove(str(HARNESS))
        for name in set(sys.modules) - before:
            if name in HARNESS_MODULES:
                del sys.modules[name]


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    """The whole check on CPU: every 4-rank run through rank.py (the preflight under torchrun, the
    others forked as torchrun would start them), each judged and summarised; the steps whose
    harness path another runs, and the GPU-only ones, SKIP with the reason."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    p = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=400)
    log = (tmp_path / "gpu_check.log").read_text()
    assert p.returncode == 0, log[-6000:] + p.stderr[-2000:]
    summary = log[log.index(" SUMMARY "):]
    assert "overall: PASS (0 FAIL" in summary, summary
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["dry_run"] and not res["gpu"] and res["preflight_ok"] is True
    status = {k: v["status"] for k, v in res["steps"].items()}
    # pretrain() runs where a core_v0.16.1 tree is at hand: MEGATRON_LM_DIR, or make gpu-wheels' tarball.
    tree = os.environ.get("MEGATRON_LM_DIR") or (REPO / ".whl" / "Megatron-LM-core_v0.16.1.tar.gz").exists()
    pretrain = "PASS" if tree else "SKIP"
    assert status == {"env": "PASS", "preflight": "PASS", "zebra": "PASS", "distep": "SKIP", "cp2": "PASS",
                      "zebra-threads": "PASS",
                      "resume": "PASS", "pools": "PASS", "fp16-overflow": "PASS", "distopt": "SKIP",
                      "pretrain": pretrain, "host-syncs": "SKIP", "transformer-engine": "SKIP",
                      "pp2-1f1b": "PASS"}, summary  # no fallback listed: the preflight passed
    steps = res["steps"]
    assert list(steps) == list(status)  # the running order: pp2-1f1b last
    for name in ("distep", "distopt"):
        assert steps[name]["summary"].startswith("--dry-run: the same harness path as step"), steps[name]
    assert steps["host-syncs"]["summary"].startswith("GPU only"), steps["host-syncs"]
    # Four ranks, each its own NCCL host, through the same launch the GPU runs use.
    ranks = steps["preflight"]["data"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert len({r["nccl_hostid"] for r in ranks}) == 4 and all(r["backend"] == "gloo" for r in ranks)
    assert {k for k in ranks[0]["groups"]["plan_2x2_r4"]} >= {"zp", "attention_dp", "replica", "world", "counts"}
    # The comparison ran on two CPU kernels: fp32 losses within the bound (measured: bitwise).
    z = steps["zebra"]["data"]
    assert len(z["gpu"]) == 6 and max(abs(a - b) / b for a, b in zip(z["gpu"], z["cpu"])) <= 3e-6
    assert "steps 4-6 bitwise the uninterrupted run's" in steps["resume"]["summary"]
    assert steps["cp2"]["summary"].startswith("zebra CP 2 fp32: gloo vs CPU max rel diff"), steps["cp2"]
    assert "not refused; losses bitwise the single issuer's" in steps["zebra-threads"]["summary"]
    for name in ("pools", "fp16-overflow"):
        assert "alike on every rank" in steps[name]["summary"], steps[name]


# ---- judgements --------------------------------------------------------------------------------
def test_judge_refusal_is_a_users_error_naming_the_flag(harness):
    import judge

    out = ("W1206 warn\nerror: rank 2: --hetero-zebra-issuer threads issues NCCL calls from several threads; "
           "use single\nTraceback (most recent call last):\n")
    assert judge.refusal(out, "--hetero-zebra-issuer").startswith("--hetero-zebra-issuer threads issues")
    assert judge.refusal("hetermoe train: error: --hetero-zebra-issuer threads: refused", "--hetero-zebra-issuer")
    # A crash whose message mentions the flag is not a refusal by name.
    assert judge.refusal("RuntimeError: --hetero-zebra-issuer threads crashed", "--hetero-zebra-issuer") is None
    assert judge.first_error("x\nRuntimeError: boom\n") == "boom"


def test_judge_per_rank_agreement_and_dtypes(harness):
    import judge

    rep = lambda scales, dtypes: {"train_hetero": {"loss_scales": scales, "param_dtypes": dtypes}}  # noqa: E731
    same = {r: rep([8.0, 4.0], ["torch.bfloat16"] if r < 2 else ["torch.float16"]) for r in range(4)}
    assert judge.same_on_every_rank(same, "loss_scales")[0]
    odd = {**same, 3: rep([8.0, 8.0], ["torch.float16"])}
    ok, line = judge.same_on_every_rank(odd, "loss_scales")
    assert not ok and "rank 3: [8.0, 8.0]" in line
    assert not judge.same_on_every_rank({0: {"exit": 1}}, "loss_scales")[0]  # a rank that did not report
    roles = {0: "attention", 1: "attention", 2: "expert", 3: "expert"}
    want = {"attention": "torch.bfloat16", "expert": "torch.float16"}
    assert judge.dtypes_by_role(same, roles, want)[0]
    ok, line = judge.dtypes_by_role({**same, 2: rep([8.0], ["torch.bfloat16"])}, roles, want)
    assert not ok and "rank 2 (expert)" in line


def test_judge_losses(harness):
    import judge

    full = [5.5, 5.4, 5.3, 5.2, 5.1, 5.0]
    assert judge.resumed_bitwise(full, [5.2, 5.1, 5.0], 3)[0]
    ok, line = judge.resumed_bitwise(full, [5.2, 5.1 + 1e-15, 5.0], 3)
    assert not ok and "steps [5]" in line
    assert not judge.resumed_bitwise(full, [5.2, 5.1], 3)[0]
    assert judge.compare_losses("x", [1.0, 2.0], [1.0, 2.0 * (1 + 2e-6)], 3e-6)[0]
    assert not judge.compare_losses("x", [1.0, 2.0], [1.0, 2.0 * (1 + 4e-6)], 3e-6)[0]
    assert not judge.compare_losses("x", [1.0], [1.0, 2.0], 3e-6)[0]  # a missing step is not a match
    assert not judge.compare_losses("x", [float("nan")], [1.0], 3e-6)[0]
    line = (" iteration        2/       3 | consumed samples:         16 | elapsed time per iteration (ms): 9.1 | "
            "learning rate: 7.7E-04 | global batch size:     8 | lm loss: 5.912021E+00 | loss scale: 1.0 |")
    assert judge.losses_from_log(line) == {2: 5.912021}
    assert judge.stage_message_bytes(512, 1024, 4) > 4 * 2**20  # the PP step's message is above NCCL's buffer


# ---- the per-rank wrapper ------------------------------------------------------------------------
def test_rank_wrapper_makes_each_rank_a_host_of_one_gpu_and_reports(tmp_path):
    """rank.py under GPU_CHECK_SAME_GPU: the rank's own NCCL_HOSTID (from torchrun's LOCAL_RANK),
    LOCAL_RANK 0 of LOCAL_WORLD_SIZE 1, the script run as __main__ with its arguments and its
    directory first on sys.path; the exit status and the pid reported."""
    script = tmp_path / "entry.py"
    script.write_text("import json, os, sys\n"
                      "print(json.dumps({k: os.environ.get(k) for k in ('NCCL_HOSTID', 'LOCAL_RANK', "
                      "'LOCAL_WORLD_SIZE', 'GPU_CHECK_LOCAL_RANK')}), sys.argv[1:], sys.path[0] == os.path.dirname("
                      "os.path.abspath(__file__)), __name__)\nsys.exit(3)\n")
    reports = tmp_path / "ranks"
    reports.mkdir()
    env = dict(os.environ, GPU_CHECK_SAME_GPU="1", GPU_CHECK_RANK_DIR=str(reports), RANK="5", LOCAL_RANK="1",
               LOCAL_WORLD_SIZE="4")
    p = subprocess.run([sys.executable, str(HARNESS / "rank.py"), str(script), "--flag", "x"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 3, p.stderr
    got = json.loads(p.stdout[:p.stdout.index("}") + 1])
    assert got["LOCAL_RANK"] == "0" and got["LOCAL_WORLD_SIZE"] == "1" and got["GPU_CHECK_LOCAL_RANK"] == "1"
    assert got["NCCL_HOSTID"].endswith("-rank1")
    assert "['--flag', 'x'] True __main__" in p.stdout
    assert json.loads((reports / "rank5.json").read_text())["exit"] == 3
    assert (reports / "pid5").read_text().isdigit()
    # Another local rank, another host id; without GPU_CHECK_SAME_GPU nothing changes.
    env2 = dict(env, LOCAL_RANK="2", RANK="6")
    p2 = subprocess.run([sys.executable, str(HARNESS / "rank.py"), str(script)], env=env2, capture_output=True,
                        text=True, timeout=60)
    assert json.loads(p2.stdout[:p2.stdout.index("}") + 1])["NCCL_HOSTID"] != got["NCCL_HOSTID"]
    env3 = {k: v for k, v in env.items() if k != "GPU_CHECK_SAME_GPU"}
    env3.pop("NCCL_HOSTID", None)
    p3 = subprocess.run([sys.executable, str(HARNESS / "rank.py"), str(script)], env=env3, capture_output=True,
                        text=True, timeout=60)
    plain = json.loads(p3.stdout[:p3.stdout.index("}") + 1])
    assert plain["NCCL_HOSTID"] is None and plain["LOCAL_RANK"] == "1"


# ---- step selection ------------------------------------------------------------------------------
class _Ck:
    def __init__(self, dry_run=False, preflight_ok=None, env_ok=True, left=400.0):
        self.dry_run, self.preflight_ok, self.env_ok, self._left = dry_run, preflight_ok, env_ok, left

    def left(self):
        return self._left


def test_steps_order_fallbacks_and_skips(harness):
    main = harness
    chosen = main.plan_steps(None)
    names = [s.name for s in chosen]
    assert names[:2] == ["env", "preflight"] and names[-1] == "pp2-1f1b"
    assert "moe-layer" not in names and "overlap" not in names  # extras: only by name
    by = {s.name: s for s in chosen}
    # Preflight passed: the fallbacks are not needed; every 4-rank step runs.
    ok = _Ck(preflight_ok=True)
    assert main.why_skip(ok, by["nccl-1rank"], chosen).startswith("preflight passed")
    assert main.why_skip(ok, by["zebra"], chosen) is None
    # Preflight failed: the fallbacks run, the 4-rank steps SKIP saying why, single-process ones run.
    bad = _Ck(preflight_ok=False)
    assert (main.why_skip(bad, by["nccl-1rank"], chosen) is None
            and main.why_skip(bad, by["gloo-2ranks"], chosen) is None)
    assert main.why_skip(bad, by["pretrain"], chosen).startswith("preflight failed")
    assert main.why_skip(bad, by["pp2-1f1b"], chosen).startswith("preflight failed")
    assert main.why_skip(bad, by["host-syncs"], chosen) is None
    # No megatron-core: nothing after env runs.
    assert "does not import" in main.why_skip(_Ck(env_ok=False), by["preflight"], chosen)
    # Out of budget: later steps SKIP, the last keeps its own reserve.
    late = _Ck(preflight_ok=True, left=5.0)
    assert main.why_skip(late, by["distopt"], chosen) == "out of time budget"
    assert main.why_skip(late, by["pp2-1f1b"], chosen) is None
    with pytest.raises(SystemExit, match="unknown.*'nope'"):
        main.plan_steps(["zebra", "nope"])
    assert [s.name for s in main.plan_steps(["pp2-1f1b", "overlap"])] == ["env", "pp2-1f1b", "overlap"]


# ---- a timeout ends the run's ranks, also those in sessions of their own ----------------------------------
def test_timeout_kills_ranks_in_their_own_sessions(harness, tmp_path):
    """torchrun starts each rank in a session of its own: killing torchrun's process group misses
    them. The runner also kills every rank that wrote its pid (rank.py)."""
    import runner

    rank_dir = tmp_path / "ranks"
    rank_dir.mkdir()
    launcher = tmp_path / "launcher.py"
    launcher.write_text(
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
        f"open({str(rank_dir / 'pid0')!r}, 'w').write(str(c.pid))\n"
        "time.sleep(120)\n")
    ck = runner.Check(tmp_path / "log", tmp_path, tmp_path, dry_run=True, budget_s=60)
    h = ck.start("hang", [sys.executable, str(launcher)], dict(os.environ, GPU_CHECK_RANK_DIR=str(rank_dir)))
    deadline = time.monotonic() + 30
    while not (rank_dir / "pid0").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int((rank_dir / "pid0").read_text())
    proc = ck.finish(h, timeout=1.0)
    assert proc.timed_out and proc.why().startswith("timed out after")
    for _ in range(100):  # reaped by init once killed
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail(f"rank {child} in its own session survived the timeout")


def test_make_gpu_wheels_takes_the_pinned_versions():
    """`make gpu-wheels` downloads the versions constraints/ci.txt pins (megatron-core 0.16.1, the
    one the check is made for), every one of them pinned."""
    p = subprocess.run(["make", "-n", "gpu-wheels"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    pins = dict(line.lower().split("==") for line in (REPO / "constraints" / "ci.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert "not pinned" not in p.stdout + p.stderr
    for name in ("megatron-core", "pydantic", "pydantic_core", "annotated-types", "typing-inspection",
                 "typing_extensions"):
        assert f"{name}=={pins[name]}" in p.stdout.lower(), (name, p.stdout)
    assert "--python-version 3.12" in p.stdout and "--only-binary=:all:" in p.stdout
    assert "Megatron-LM-core_v0.16.1.tar.gz" in p.stdout


def test_the_package_does_not_import_the_harness():
    pkg = REPO / "megatron_hetermoe"
    assert not list(pkg.rglob("gpu_check*.py"))
    imports = []
    for path in pkg.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imports += [(path, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                imports += [(path, f"{node.module or ''}.{a.name}") for a in node.names]
    assert not [(p, n) for p, n in imports if "gpu_check" in n]


def test_a_missing_package_is_named_and_stops_what_needs_it(tmp_path):
    """Without megatron-core (as on the GPU machine before its wheels are installed) the check
    names it, points at `make gpu-wheels`, and skips the steps that need it instead of failing
    each one obscurely."""
    block = tmp_path / "block" / "megatron" / "core"
    block.mkdir(parents=True)
    (block / "__init__.py").write_text("raise ImportError('megatron-core is not installed (test)')\n")
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path / "block"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--steps", "env,preflight,zebra"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert p.returncode == 1, p.stdout[-3000:]
    env_step = res["steps"]["env"]
    assert (env_step["status"] == "FAIL"
            and env_step["summary"].startswith("MISSING megatron-core (for plugin")), env_step
    assert "make gpu-wheels" in env_step["summary"]
    for name in ("preflight", "zebra"):
        assert res["steps"][name]["status"] == "SKIP" and "does not import" in res["steps"][name]["summary"]


def test_preflight_falls_back_only_when_the_world_does_not_work(harness, tmp_path):
    """A group kind that fails is a FAIL of the preflight, but the 4-rank steps still run; only
    when the four ranks cannot run the world's collectives do the fallbacks replace them."""
    import runner
    import steps

    def outcome(world_ok: bool, group: str) -> tuple:
        rank = {"rank": 0, "groups": {"plan_2x2_r4": {"zp": "ok 4", "self": group}}, "world": {
            "all_reduce": "ok" if world_ok else "FAILED RuntimeError: NCCL error"}, "world_ok": world_ok,
            "ok": world_ok and group.startswith("ok"), "nccl_hostid": "h0", "seconds": 1.0}
        res = {"ok": rank["ok"], "world_ok": world_ok, "ranks": [rank]}
        proc = runner.Proc("preflight_gpu", 0, 1.0, runner.RESULT_TAG + json.dumps(res), False)
        ck = runner.Check(tmp_path / f"log{world_ok}{group[:2]}", tmp_path, tmp_path, dry_run=True, budget_s=60)
        ck.start_side = lambda *a, **k: None
        ck.finish_side = lambda started, timeout: runner.Run(proc, runner.Side.DEVICE, tmp_path)
        r = runner.StepResult("preflight", "")
        steps.step_preflight(ck, r)
        return ck.preflight_ok, str(r.status), r.summary

    assert outcome(True, "ok 1")[:2] == (True, "PASS")
    ok, status, summary = outcome(True, "MISSING (KeyError: 'self[0]')")
    assert (ok, status) == (True, "FAIL") and summary.startswith("the world's collectives work (the 4-rank steps run)")
    assert outcome(False, "ok 1")[:2] == (False, "FAIL")
