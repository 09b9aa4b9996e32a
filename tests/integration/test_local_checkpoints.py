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
import pytest

from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.plan.tasks import zebra_tasks_for_role
from megatron_hetermoe.planner.inventory import AutoPlanRun, Inventory, auto_plan
from megatron_hetermoe.training import args as train_args
from megatron_hetermoe.training.golden_values import read_golden
from megatron_hetermoe.vocabulary import Role, TaskKind

pytestmark = pytest.mark.slow
FLAGS = ["--model", "tiny", "--micro-batch-size", "1", "--global-batch-size", "8", "--lr-warmup-iters", "1",
         "--deterministic-mode", "--train-iters", "7"]


def _train(argv, monkeypatch, fault=None):
    if fault:
        monkeypatch.setenv("HETERMOE_INJECT_FAULT", fault)
    else:
        monkeypatch.delenv("HETERMOE_INJECT_FAULT", raising=False)
    assert train_args.main(argv) == 0


@pytest.fixture
def request_cleanup():
    import shutil

    made = []
    yield made.append
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


def test_a_lost_node_is_rebuilt_from_its_peers_copies(tiny, tmp_path, monkeypatch, capfd, request_cleanup):
    import os

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
        _train([*FLAGS, "--hetero-plan", str(tmp_path / "plan0.json"), "--save", str(tmp_path / name),
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
    _train([*FLAGS, "--hetero-plan", str(tmp_path / "plan0.json"), "--save", str(tmp_path / "ref"),
            "--save-interval", "1", "--golden-values-out", str(tmp_path / "ref.json")], monkeypatch)
    # ... from which a fresh run on the survivors' plan runs what the job ran after the loss.
    survivors.save(tmp_path / "plan1.json")
    _train([*FLAGS, "--hetero-plan", str(tmp_path / "plan1.json"), "--load", str(tmp_path / "ref"), "--ckpt-step",
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
