"""Issue 44 item 3: a job that loses a node continues from its ranks' in-memory copies, not from the
persistent checkpoint (Megatron's --non-persistent-ckpt-type local with --replication,
checkpoint/local.py, on the elastic launcher of training/elastic.py).

A 2 x (2 A40 attention + 2 V100 expert) zebra job on 8 forked CPU ranks standing for 4 nodes of 2
GPUs ($HETERMOE_RANK_NODES); local checkpoints every iteration in a tmpfs, each copied to the rank 2
away (the next node), persistent ones every 3. Both ranks of node 1 are killed (kill -9) in the
middle of iteration 6, so node 1's store is removed as a lost machine's memory would be: the job
re-plans for the 6 GPUs left and continues from iteration 5, whose node-1 files only the copies on
node 2 hold; the iterations after it equal, bitwise, a fresh run from a persistent checkpoint of
iteration 5 on the new plan. Without --replication the same loss falls back to the persistent
checkpoint of iteration 3."""
import os
import shutil

import pytest
from elastic_runs import kill_tree, train

from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.plan.tasks import zebra_tasks_for_role
from megatron_hetermoe.planner.inventory import AutoPlanRun, Inventory, auto_plan
from megatron_hetermoe.training.golden_values import read_golden
from megatron_hetermoe.vocabulary import Role, TaskKind

pytestmark = pytest.mark.slow
FLAGS = ["--model", "tiny", "--micro-batch-size", "1", "--global-batch-size", "8", "--lr-warmup-iters", "1",
         "--deterministic-mode", "--train-iters", "7"]


@pytest.fixture
def request_cleanup():
    made = []
    yield made.append
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


def test_a_lost_node_is_rebuilt_from_its_peers_copies(tiny, tmp_path, monkeypatch, capfd, request_cleanup):
    plan0 = even_plan(tiny.num_layers, tiny.num_experts, 2, 2, 2, attention_gpu="A40", expert_gpu="V100-16GB",
                      num_microbatches=2, schedule="zebra")
    plan0.save(tmp_path / "plan0.json")
    assert [plan0.role(r) for r in (2, 3)] == ["expert", "expert"]  # node 1: group 0's expert ranks
    # The "task" fault site counts compute tasks: kill in the middle of iteration 6.
    per_iter = sum(t.kind in (TaskKind.E_F, TaskKind.E_B) for t in zebra_tasks_for_role(tiny.num_layers, 2,
                                                                                           Role.EXPERT))
    fault = ";".join(f"rank={r},site=task,at={5 * per_iter + per_iter // 2},mode=kill" for r in (2, 3))
    survivors, _ = auto_plan(AutoPlanRun(tiny, tiny.seq_length, 8, 1),
                             Inventory.from_spec("2xA40,2xV100-16GB,2xA40,2xV100-16GB").without([2, 3]))
    store = f"/dev/shm/hetermoe-test-{os.getpid()}"
    request_cleanup(store)

    def job(name, replication):
        train([*FLAGS, "--hetero-plan", str(tmp_path / "plan0.json"), "--save", str(tmp_path / name),
                "--save-interval", "3", "--elastic-restarts", "1", "--non-persistent-ckpt-type", "local",
                "--non-persistent-local-ckpt-dir", store, "--non-persistent-save-interval", "1",
                *(["--replication", "--replication-jump", "2"] if replication else []),
                "--golden-values-out", str(tmp_path / f"{name}.json")], monkeypatch, fault)
        out = capfd.readouterr().out
        return [line for line in out.splitlines() if line.startswith(("elastic:", " elastic restart"))], out

    lines, out = job("el", replication=True)
    assert len(lines) == 2, out[-3000:]
    assert "lost rank(s) [2, 3]" in lines[0] and "node(s) [1] lost with their memory" in lines[0], lines
    assert "resumed from the local checkpoint of iteration 5, 0 step(s) run again" in lines[1], lines
    assert f"-> {survivors.world_size} ranks" in lines[1], lines
    assert " local checkpoints: " in out and "copies on 1 other rank(s)" in out
    assert not os.listdir(store), "the job's store outlived it"

    # The reference: the same job without faults saves a persistent checkpoint of iteration 5 ...
    train([*FLAGS, "--hetero-plan", str(tmp_path / "plan0.json"), "--save", str(tmp_path / "ref"),
            "--save-interval", "1", "--golden-values-out", str(tmp_path / "ref.json")], monkeypatch)
    # ... from which a fresh run on the survivors' plan runs what the job ran after the loss.
    survivors.save(tmp_path / "plan1.json")
    train([*FLAGS, "--hetero-plan", str(tmp_path / "plan1.json"), "--load", str(tmp_path / "ref"), "--ckpt-step",
            "5", "--hetero-ckpt-reshard", "--golden-values-out", str(tmp_path / "fresh.json")], monkeypatch)
    capfd.readouterr()
    elastic, ref, fresh = (read_golden(tmp_path / f"{n}.json") for n in ("el", "ref", "fresh"))
    assert sorted(elastic) == list(range(1, 8))
    assert {i: elastic[i] for i in range(1, 6)} == {i: ref[i] for i in range(1, 6)}
    assert {i: elastic[i] for i in (6, 7)} == {i: fresh[i] for i in (6, 7)}, (elastic, fresh)

    # Without copies on other nodes, node 1's state is gone with it: the persistent checkpoint of 3.
    lines, out = job("nocopy", replication=False)
    assert "resumed from iteration 3, 2 step(s) run again" in lines[1], lines
    assert read_golden(tmp_path / "nocopy.json") == elastic


def test_torchrun_node_lost_then_back(tiny, tmp_path, request_cleanup):
    """Under torchrun's elastic agent (two agents on this host, --nnodes 1:2, each its own node by
    $HETERMOE_NODE, 2 A40 and 2 V100 by $HETERMOE_GPU_TYPE; --hetero-plan auto): local checkpoints
    every iteration copied to the other node; the V100 node is killed (agent and workers) and its
    store removed, as a lost machine's memory; the A40 node's workers restart in a world of 2, plan
    for 2 A40 and continue from the local checkpoint, the V100 ranks' state from their copies on the
    A40 node (no persistent checkpoint exists: --save-interval is past the run). Then a V100 node
    starts again: the agent restarts its workers in a world of 4 (grow), which plan for 2 A40 + 2
    V100 and continue from the latest local checkpoint, its files brought to the new node."""
    import re
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ck, store, run_id = tmp_path / "ck", f"/dev/shm/hetermoe-test-tr-{os.getpid()}", f"lost-{os.getpid()}"
    request_cleanup(store)
    iters = 150

    def node(gpu: str, log: str, host: bool):
        cmd = [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node",
               "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
               "--max-restarts", "2", "--rdzv-conf", f"is_host={int(host)},last_call_timeout=20,join_timeout=180",
               "--monitor-interval", "0.5", "-m", "megatron_hetermoe.training.args", *FLAGS[:-2], "--train-iters",
               str(iters), "--hetero-plan", "auto", "--save", str(ck), "--load", str(ck), "--save-interval", "100",
               "--hetero-ckpt-reshard", "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir",
               store, "--non-persistent-save-interval", "1", "--replication", "--replication-jump", "2",
               "--golden-values-out", str(tmp_path / f"{gpu}.json")]
        # torch's opt-out of the shared TCP store: with it, a node joining a later round waits for a
        # MASTER_ADDR the first round's rank 0 never publishes again (torch 2.13, scale-up).
        env = {**os.environ, "HETERMOE_GPU_TYPE": gpu, "HETERMOE_NODE": gpu, "OMP_NUM_THREADS": "1",
               "HETERMOE_COLLECTIVE_TIMEOUT_S": "60", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        for k in ("HETERMOE_ELASTIC_ATTEMPT", "HETERMOE_INJECT_FAULT", "HETERMOE_RANK_NODES"):
            env.pop(k, None)
        return subprocess.Popen(cmd, stdout=open(tmp_path / log, "w"), stderr=subprocess.STDOUT, env=env,
                                cwd=tmp_path, start_new_session=True)

    def wait_for(pattern: str, log: str, procs, after: int = 0) -> re.Match:
        deadline = time.monotonic() + 300
        while True:
            m = re.search(pattern, (tmp_path / log).read_text()[after:])
            if m:
                return m
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                (tmp_path / log).read_text()[-3000:]
            time.sleep(0.1)

    a40 = node("A40", "a40.log", host=True)
    v100 = node("V100-16GB", "v100.log", host=False)
    back = None
    try:
        logs = lambda: (tmp_path / "a40.log").read_text() + (tmp_path / "v100.log").read_text()  # noqa: E731
        deadline = time.monotonic() + 300
        while " iteration        4/" not in logs():
            assert time.monotonic() < deadline and a40.poll() is None and v100.poll() is None, logs()[-3000:]
            time.sleep(0.1)
        kill_tree(v100.pid)
        shutil.rmtree(f"{store}/{run_id}/V100-16GB", ignore_errors=True)  # the machine's memory, gone with it
        m = wait_for(r"loaded checkpoint (\S+) at iteration (\d+)", "a40.log", [a40])
        shrunk = (m.group(1), int(m.group(2)))
        seen = m.end()
        wait_for(rf" iteration +{shrunk[1] + 3}/", "a40.log", [a40], seen)
        seen = len((tmp_path / "a40.log").read_text())
        back = node("V100-16GB", "v100b.log", host=False)  # the node comes back
        m = wait_for(r"loaded checkpoint (\S+) at iteration (\d+)", "a40.log", [a40, back], seen)
        grown = (m.group(1), int(m.group(2)))
        assert a40.wait(timeout=400) == 0, (tmp_path / "a40.log").read_text()[-4000:]
        assert back.wait(timeout=60) == 0, (tmp_path / "v100b.log").read_text()[-4000:]
    finally:
        for p in (a40, v100, back):
            if p is not None and p.poll() is None:
                kill_tree(p.pid)
    out = (tmp_path / "a40.log").read_text()
    picks = [line for line in out.splitlines() if "--hetero-plan auto:" in line]
    assert "for this job's 2 A40 + 2 V100-16GB" in picks[0], picks
    assert "for this job's 2 A40;" in picks[1] and "for this job's 2 A40 + 2 V100-16GB" in picks[-1], picks
    # each start after a change loads a local checkpoint from its node's store (no persistent one exists)
    assert shrunk[0].endswith(f"{run_id}/A40/restore") and grown[0].endswith("/restore"), (shrunk, grown)
    # after the loss both ranks are on one node: rank n+2 is rank n again, and the job says so
    assert "local checkpoints of rank(s) [0, 1] have no copy on another node" in out
    assert shrunk[1] >= 3 and grown[1] >= shrunk[1] + 3, (shrunk, grown)  # iteration 4 had started at the kill
    assert sorted(read_golden(tmp_path / "A40.json")) == list(range(grown[1] + 1, iters + 1))
    from megatron_hetermoe.checkpoint.format import locate
    from megatron_hetermoe.plan.hetero_plan import HeteroPlan

    final = HeteroPlan.from_dict(locate(ck, iters)[1]["layout"]["plan"])
    assert final.world_size == 4 and sorted(set(final.gpu_types)) == ["A40", "V100-16GB"]


@pytest.mark.parametrize("trainer", ["megatron-ep", "hetero-bf16-distopt"])
def test_a_restart_resumes_from_the_local_checkpoint_bitwise(trainer, tiny, tmp_path, monkeypatch, capfd):
    """Without the elastic launcher: a run saving local checkpoints every iteration (persistent ones
    every 3) loses a rank (kill -9) at the start of iteration 6 and ends; run again with --load on
    the same layout, it continues from the newest complete local checkpoint (RNG included), and its
    iterations equal an uninterrupted run's, bitwise. Megatron EP's own trainer (EP 2 over 4 ranks),
    and HeterMoE's DistEP plan (2 x (1 attention + 2 expert ranks)) with bf16 and the distributed
    optimizer."""
    import re

    from megatron_hetermoe.checkpoint.local import JOB_ENV
    from megatron_hetermoe.parallel.launcher import LaunchError
    from megatron_hetermoe.training import args as train_args

    store = f"/dev/shm/hetermoe-test-rs-{os.getpid()}-{trainer}"
    monkeypatch.setenv(JOB_ENV, "restart-test")
    if trainer == "megatron-ep":
        layout = ["--nproc", "4", "--expert-model-parallel-size", "2"]
    else:
        plan = even_plan(tiny.num_layers, tiny.num_experts, 1, 2, 2, attention_gpu="A40", expert_gpu="A40",
                         num_microbatches=4, schedule="distep")
        plan.save(tmp_path / "plan.json")
        layout = ["--hetero-plan", str(tmp_path / "plan.json"), "--bf16", "--use-distributed-optimizer"]
    local = ["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", store,
             "--non-persistent-save-interval", "1"]
    try:
        train([*FLAGS, *layout, "--golden-values-out", str(tmp_path / "ref.json")], monkeypatch)
        run = [*FLAGS, *layout, *local, "--save", str(tmp_path / "ck"), "--save-interval", "3"]
        monkeypatch.setenv("HETERMOE_INJECT_FAULT", "rank=1,site=iteration,at=5,mode=kill")
        with pytest.raises(LaunchError, match="rank 1 of [46] failed: exited with signal 9"):
            train_args.main([*run, "--golden-values-out", str(tmp_path / "a.json")])
        monkeypatch.delenv("HETERMOE_INJECT_FAULT")
        capfd.readouterr()
        train([*run, "--load", str(tmp_path / "ck"), "--golden-values-out", str(tmp_path / "b.json")], monkeypatch)
        out = capfd.readouterr().out
    finally:
        shutil.rmtree(store, ignore_errors=True)
    m = re.search(r"loaded checkpoint (\S+) at iteration (\d+)", out)
    assert m and m.group(1).endswith("/restore") and "resharded" not in out, out[-3000:]
    resumed = int(m.group(2))
    assert resumed in (4, 5), resumed  # 5, or 4 where the kill came while 5's copy was being written
    ref, after = read_golden(tmp_path / "ref.json"), read_golden(tmp_path / "b.json")
    assert sorted(after) == list(range(resumed + 1, 8)) and after == {i: ref[i] for i in after}, (ref, after)
