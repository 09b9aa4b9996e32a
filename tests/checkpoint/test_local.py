"""Megatron's non-persistent local checkpoints (checkpoint/local.py): who keeps whose copy, which
local checkpoint a restart takes, the persistent format assembled from a store, Megatron's flag
rules. The training runs that use them are in tests/integration/test_local_checkpoints.py."""
import hashlib

import pytest
import torch

from megatron_hetermoe.checkpoint import local
from megatron_hetermoe.checkpoint.format import CheckpointError, locate, rank_file_name
from megatron_hetermoe.config import LocalCheckpointConfig
from megatron_hetermoe.training import args as train_args


def _cfg(jump, factor=2):
    return LocalCheckpointConfig("/dev/shm/x", 1, jump, factor)


def test_replicas_go_jump_ranks_away_and_every_copy_has_one_keeper():
    cfg = _cfg(2)
    assert [local.replica_holders(r, 8, cfg) for r in range(8)] == [[2], [3], [4], [5], [6], [7], [0], [1]]
    assert local.replica_sources(2, 8, cfg) == [0] and local.replica_sources(0, 8, cfg) == [6]
    # factor 3: two copies, 2 and 4 ranks away; a world of 7 (after a loss) wraps around
    cfg3 = _cfg(2, 3)
    assert local.replica_holders(5, 7, cfg3) == [0, 2]
    for world in (2, 5, 7, 8):
        for r in range(world):
            for h in local.replica_holders(r, world, cfg3):
                assert r in local.replica_sources(h, world, cfg3)
    assert local.replica_holders(0, 1, cfg) == []  # one rank: no other to keep a copy
    assert local.replica_holders(3, 8, LocalCheckpointConfig("/d", 1)) == []  # no --replication


def test_newest_complete_snapshot_is_taken_over_the_stores():
    stores = {
        "node0": {(1, 4): {"world_size": 4, "ranks": [0, 1, 3]}, (1, 5): {"world_size": 4, "ranks": [0, 1]}},
        "node2": {(1, 4): {"world_size": 4, "ranks": [2]}, (1, 5): {"world_size": 4, "ranks": [2]},
                  (2, 3): {"world_size": 2, "ranks": [0, 1]}},
    }
    # iteration 5 lacks rank 3 everywhere; 4 is complete across the two nodes
    assert local.newest_complete(stores) == (1, 4)
    stores["node2"][(1, 5)]["ranks"].append(3)
    assert local.newest_complete(stores) == (1, 5)
    assert local.newest_complete({"node0": {(1, 4): {"world_size": 2, "ranks": [1]}}}) is None
    assert local.newest_complete({}) is None


def _snapshot(d, world=2, damage=None):
    for q in range(world):
        data = f"rank {q} state".encode()
        meta = {"rank": q, "world_size": world, "iteration": 6, "role": "attention", "params": {f"w{q}": [2]},
                "sha256": hashlib.sha256(data).hexdigest(),
                "manifest": {"trainer": "hetero", "world_size": world, "model": {}, "layout": {}, "train": {}}}
        local._write(d, q, data if q != damage else b"rank X state", meta)


def test_scan_sees_only_complete_files_and_assemble_writes_the_persistent_format(tmp_path):
    snap = tmp_path / "node0" / "g1" / "iter_0000006"
    _snapshot(snap)
    (snap / "rank_5.pt").write_bytes(b"half")  # no .json: a copy still being written
    assert local.scan(tmp_path / "node0") == {(1, 6): {"world_size": 2, "ranks": [0, 1]}}
    out = tmp_path / "node0" / "restore"
    local.assemble(snap, 6, out)
    d, manifest = locate(out)
    assert manifest["iteration"] == 6 and sorted(manifest["files"]) == [rank_file_name(0), rank_file_name(1)]
    assert (d / rank_file_name(1)).read_bytes() == b"rank 1 state"


def test_a_damaged_copy_is_refused_by_its_saved_sha256(tmp_path):
    snap = tmp_path / "g1" / "iter_0000006"
    _snapshot(snap, damage=1)
    with pytest.raises(CheckpointError, match="rank_1.pt: sha256 .* the copy is damaged"):
        local.assemble(snap, 6, tmp_path / "restore")


def test_bytes_travel_as_uint8_tensors():
    t = local._bytes_tensor(b"abc")
    assert t.dtype == torch.uint8 and t.numpy().tobytes() == b"abc"
    assert local._bytes_tensor(b"").numel() == 0


def test_nodes_come_from_the_launcher_or_the_host(monkeypatch):
    monkeypatch.delenv(local.NODE_ENV, raising=False)
    monkeypatch.setenv(local.NODES_ENV, "0,0,1,1")
    assert [local.node_of(r) for r in range(4)] == ["node0", "node0", "node1", "node1"]
    with pytest.raises(ValueError, match="none for rank 4"):
        local.node_of(4)
    monkeypatch.setenv(local.NODE_ENV, "v100-node")  # this process's node wins
    assert local.node_of(0) == "v100-node"
    monkeypatch.delenv(local.NODE_ENV)
    monkeypatch.delenv(local.NODES_ENV)
    import socket

    assert local.node_of(3) == socket.gethostname()
    for k in (local.JOB_ENV, "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(k, raising=False)
    assert local.job_of() == "default"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run7")
    assert local.job_of() == "run7"


BASE = ["--model", "tiny"]


@pytest.mark.parametrize("flags,error", [
    (["--non-persistent-ckpt-type", "global"], "--non-persistent-ckpt-type global: not built here"),
    (["--non-persistent-ckpt-type", "in_memory"], "--non-persistent-ckpt-type in_memory: not built here"),
    (["--non-persistent-ckpt-type", "local"], "needs --non-persistent-local-ckpt-dir"),
    (["--non-persistent-save-interval", "2"], "needs --non-persistent-ckpt-type local"),
    (["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "/dev/shm/x",
      "--non-persistent-save-interval", "0"], "must be a positive number"),
    (["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "/dev/shm/x", "--replication"],
     "--replication needs --replication-jump"),
    (["--replication", "--replication-jump", "2"], "--replication needs --non-persistent-ckpt-type local"),
    (["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "/dev/shm/x", "--replication",
      "--replication-jump", "2", "--replication-factor", "1"], "--replication-factor 1"),
])
def test_megatron_flag_rules(flags, error, capsys):
    with pytest.raises(SystemExit):
        train_args.main([*BASE, *flags])
    assert error in capsys.readouterr().err


def test_flags_make_the_config(capsys):
    p = train_args.build_parser(60.0)
    a = p.parse_args([*BASE, "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "/dev/shm/c",
                      "--non-persistent-save-interval", "1", "--replication", "--replication-jump", "4"])
    assert train_args.config_from_args(a).local_ckpt == LocalCheckpointConfig("/dev/shm/c", 1, 4, 2)
    a = p.parse_args([*BASE, "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "/d",
                      "--replication-jump", "4"])
    assert train_args.config_from_args(a).local_ckpt == LocalCheckpointConfig("/d", None, None, 2)
    assert "--replication-jump was specified despite not using replication. Ignoring." in capsys.readouterr().out
    assert train_args.config_from_args(p.parse_args(BASE)).local_ckpt is None
