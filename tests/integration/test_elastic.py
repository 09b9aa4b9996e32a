"""Issue 44: a job that loses GPUs goes on (`hetermoe train --elastic-restarts`, training/elastic.py).

A 2 x (2 A40 attention + 2 V100 expert) job on 8 forked CPU ranks loses, by SIGKILL (kill -9,
$HETERMOE_INJECT_FAULT mode=kill at the start of an iteration): an expert rank, then an attention
rank of the re-planned job, then two ranks at once. Each time the job re-plans for the GPUs left
(the planner's search) and continues from the latest checkpoint; the losses of each start after a
failure equal, bitwise, those of a fresh run from that checkpoint on that plan."""
import pytest
from elastic_runs import kill_tree, train

from megatron_hetermoe.checkpoint.format import locate
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, even_plan
from megatron_hetermoe.planner.inventory import AutoPlanRun, Inventory, auto_plan
from megatron_hetermoe.training import args as train_args
from megatron_hetermoe.training.golden_values import read_golden

pytestmark = pytest.mark.slow
FLAGS = ["--model", "tiny", "--micro-batch-size", "1", "--global-batch-size", "8", "--lr-warmup-iters", "1",
         "--deterministic-mode"]


def test_lose_an_expert_then_an_attention_rank_then_two_at_once(tiny, tmp_path, monkeypatch, capfd):
    plan0 = even_plan(tiny.num_layers, tiny.num_experts, 2, 2, 2, attention_gpu="A40", expert_gpu="V100-16GB",
                      num_microbatches=2, schedule="zebra")
    plan0.save(tmp_path / "plan0.json")
    assert plan0.role(2) == "expert"
    # The plans the job must arrive at (what training/elastic.py computes: plan rank i on inventory rank kept[i]).
    run = AutoPlanRun(tiny, tiny.seq_length, 8, 1)
    alive = Inventory.from_spec("2xA40,2xV100-16GB,2xA40,2xV100-16GB")
    alive = alive.without([2])
    plan1, on1 = auto_plan(run, alive)
    a1 = plan1.groups[0].attention_ranks[0]
    alive = alive.without([on1[a1]])
    plan2, on2 = auto_plan(run, alive)
    two = sorted({plan2.groups[0].attention_ranks[-1], plan2.groups[-1].expert_ranks[-1]})
    alive = alive.without([on2[r] for r in two])
    plan3, _ = auto_plan(run, alive)
    fault = ";".join(["rank=2,site=iteration,at=2,mode=kill,attempt=0",
                      f"rank={a1},site=iteration,at=4,mode=kill,attempt=1",
                      *(f"rank={r},site=iteration,at=5,mode=kill,attempt=2" for r in two)])
    ck = tmp_path / "ck"
    train([*FLAGS, "--train-iters", "7", "--hetero-plan", str(tmp_path / "plan0.json"), "--save", str(ck),
            "--save-interval", "1", "--elastic-restarts", "3", "--golden-values-out", str(tmp_path / "el.json")],
           monkeypatch, fault)
    out = capfd.readouterr().out
    restarts = [line for line in out.splitlines() if line.startswith(" elastic restart")]
    assert len(restarts) == 3, out[-3000:]
    assert "lost ['V100-16GB']" in restarts[0] and "lost ['A40']" in restarts[1], restarts
    assert restarts[2].count("'") == 4, restarts  # two GPUs at once
    for line, (resumed, size) in zip(restarts, ((2, plan1.world_size), (4, plan2.world_size), (5, plan3.world_size))):
        assert f"resumed from iteration {resumed}, 0 step(s) run again" in line and f"-> {size} ranks" in line, line
    elastic = read_golden(tmp_path / "el.json")
    assert sorted(elastic) == list(range(1, 8)), elastic
    # Each start after a failure = a fresh run from the checkpoint it loaded, on its plan.
    for k, (plan, start, end) in enumerate(((plan1, 2, 4), (plan2, 4, 5), (plan3, 5, 7)), 1):
        saved = HeteroPlan.from_dict(locate(ck, end)[1]["layout"]["plan"])
        assert saved.to_dict()["groups"] == plan.to_dict()["groups"], f"restart {k} ran another plan"
        plan.save(tmp_path / f"plan{k}.json")
        train([*FLAGS, "--train-iters", "7", "--hetero-plan", str(tmp_path / f"plan{k}.json"), "--load",
                str(ck), "--ckpt-step", str(start), "--hetero-ckpt-reshard", "--golden-values-out",
                str(tmp_path / f"fresh{k}.json")], monkeypatch)
        fresh = read_golden(tmp_path / f"fresh{k}.json")
        # the same --train-iters (the LR schedule's length); the start ran start+1..end before its failure
        assert {i: fresh[i] for i in range(start + 1, end + 1)} == \
            {i: elastic[i] for i in range(start + 1, end + 1)}, (k, fresh, elastic)



def test_torchrun_loses_a_node_and_replans_for_the_survivors(tiny, tmp_path):
    """Under torchrun's elastic agent (two agents, --nnodes 1:2, c10d rendezvous: two "nodes" on this
    host, of 2 A40 and 2 V100, each rank's type from $HETERMOE_GPU_TYPE), --hetero-plan auto gathers
    every rank's GPU at start and plans for them; the V100 node is killed (agent and workers, SIGKILL)
    mid-run; the A40 node's agent restarts its workers in a world of 2, which plan again for 2 A40 and
    continue from the latest checkpoint (--load, --hetero-ckpt-reshard); the iterations after it equal
    a fresh run from that checkpoint on that plan, bitwise."""
    import os
    import re
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ck = tmp_path / "ck"

    def node(gpu: str, log: str, host: bool):
        cmd = [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node",
               "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test",
               "--max-restarts", "2", "--rdzv-conf", f"is_host={int(host)},last_call_timeout=30,join_timeout=180",
               "--monitor-interval", "0.5", "-m", "megatron_hetermoe.training.args", *FLAGS, "--train-iters", "8",
               "--hetero-plan", "auto", "--save", str(ck), "--load", str(ck), "--save-interval", "1",
               "--hetero-ckpt-reshard", "--golden-values-out", str(tmp_path / f"{gpu}.json")]
        env = {**os.environ, "HETERMOE_GPU_TYPE": gpu, "OMP_NUM_THREADS": "1", "HETERMOE_COLLECTIVE_TIMEOUT_S": "60"}
        for k in ("HETERMOE_ELASTIC_ATTEMPT", "HETERMOE_INJECT_FAULT"):
            env.pop(k, None)
        return subprocess.Popen(cmd, stdout=open(tmp_path / log, "w"), stderr=subprocess.STDOUT, env=env,
                                cwd=tmp_path, start_new_session=True)

    # The A40 node hosts the rendezvous store, which must outlive the V100 node. Both join the first
    # round (it closes when both are in; last_call_timeout only bounds the wait once a round has its
    # minimum, one node: after the kill it is the survivor's wait for others before it restarts).
    a40 = node("A40", "a40.log", host=True)
    v100 = node("V100-16GB", "v100.log", host=False)
    tracker = ck / "latest_checkpointed_iteration.txt"
    try:
        deadline = time.monotonic() + 300
        while not (tracker.exists() and int(tracker.read_text() or 0) >= 2):
            assert time.monotonic() < deadline and a40.poll() is None and v100.poll() is None, \
                (tmp_path / "a40.log").read_text()[-3000:]
            time.sleep(0.1)
        kill_tree(v100.pid)
        assert a40.wait(timeout=400) == 0, (tmp_path / "a40.log").read_text()[-4000:]
    finally:
        for p in (a40, v100):
            if p.poll() is None:
                kill_tree(p.pid)
    out = (tmp_path / "a40.log").read_text()
    picks = [line for line in out.splitlines() if "--hetero-plan auto:" in line]
    assert "for this job's 2 A40 + 2 V100-16GB" in picks[0] and "for this job's 2 A40;" in picks[-1], picks
    resumed = int(re.findall(r"loaded checkpoint \S+ at iteration (\d+)", out)[-1])
    after = read_golden(tmp_path / "A40.json")
    assert sorted(after) == list(range(resumed + 1, 9)), (resumed, after)
    plan = HeteroPlan.from_dict(locate(ck, 8)[1]["layout"]["plan"])
    assert plan.world_size == 2 and set(plan.gpu_types) == {"A40"}
    plan.save(tmp_path / "picked.json")
    ref = tmp_path / "ref.json"
    assert train_args.main([*FLAGS, "--train-iters", "8", "--hetero-plan", str(tmp_path / "picked.json"), "--load",
                            str(ck), "--ckpt-step", str(resumed), "--hetero-ckpt-reshard",
                            "--golden-values-out", str(ref)]) == 0
    assert after == read_golden(ref)
