"""tests/fork_torchrun.py, the tests' stand-in for torchrun: torchrun's environment per rank, the
script as __main__, a failing rank ends the others, and the zygote serves runs one after another."""
from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

import megatron_lm_run

@pytest.fixture(autouse=True)
def forked(monkeypatch):
    monkeypatch.delenv("HETERMOE_TESTS_TORCHRUN", raising=False)  # these test the forked runs


SCRIPT = '''
import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} of {os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']}/{os.environ['LOCAL_WORLD_SIZE']} "
      f"at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} as {__name__} argv {sys.argv[1:]}", flush=True)
if "--fail" in sys.argv and rank == 1:
    raise ValueError("rank 1 refuses")
if "--fail" in sys.argv:
    time.sleep(120)  # a peer waiting on the failed rank: the launcher must end it
'''


def test_ranks_get_torchruns_environment(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text(SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        r = megatron_lm_run._forked_run(tmp_path, 3, port, ["pretrain_gpt.py", "--x", "1"], megatron_lm_run.env(), 60)
    finally:
        megatron_lm_run._stop_zygotes()
    assert r.returncode == 0, r.stdout
    for rank in range(3):
        assert f"rank {rank} of 3 local {rank}/3 at 127.0.0.1:{port} as __main__ argv ['--x', '1']" in r.stdout


def test_a_failing_rank_ends_the_others(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text(SCRIPT)
    t0 = time.monotonic()
    try:
        r = megatron_lm_run.torchrun(tmp_path, 3, ["--fail"], timeout=100)
    finally:
        megatron_lm_run._stop_zygotes()
    assert r.returncode == 1
    assert "ValueError: rank 1 refuses" in r.stdout
    assert "fork_torchrun: rank 1 failed first (exit code 1)" in r.stdout
    assert time.monotonic() - t0 < 60, "the waiting ranks were not ended"


def test_zygote_serves_runs_in_turn(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text(SCRIPT)
    zygotes = []
    try:
        ok = megatron_lm_run.torchrun(tmp_path, 2, ["--a"], timeout=60)
        zygotes.append(megatron_lm_run._zygote(tmp_path, megatron_lm_run.env()))
        failed = megatron_lm_run.torchrun(tmp_path, 2, ["--fail"], timeout=100)
        again = megatron_lm_run.torchrun(tmp_path, 2, ["--b"], timeout=60)
        zygotes.append(megatron_lm_run._zygote(tmp_path, megatron_lm_run.env()))
    finally:
        megatron_lm_run._stop_zygotes()
    assert zygotes[0] == zygotes[1]  # one zygote served all three runs
    assert not Path(zygotes[0]).parent.exists()  # its socket's directory is gone with it
    assert ok.returncode == 0 and "rank 1 of 2 local 1/2" in ok.stdout and "argv ['--a']" in ok.stdout
    assert failed.returncode == 1 and "ValueError: rank 1 refuses" in failed.stdout
    assert again.returncode == 0 and "argv ['--b']" in again.stdout
