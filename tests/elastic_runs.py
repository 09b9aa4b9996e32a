"""Helpers of the tests that lose ranks: a training with injected faults, and killing a node."""
import os
import signal
import subprocess


def train(argv: list[str], monkeypatch, fault: str | None = None) -> None:
    """`hetermoe train argv` on forked ranks with $HETERMOE_INJECT_FAULT = fault (none: unset)."""
    from megatron_hetermoe.training import args as train_args

    if fault:
        monkeypatch.setenv("HETERMOE_INJECT_FAULT", fault)
    else:
        monkeypatch.delenv("HETERMOE_INJECT_FAULT", raising=False)
    assert train_args.main(argv) == 0


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything under it (a node: torchrun's agent and its workers)."""
    kids = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    os.kill(pid, signal.SIGSTOP)  # no new children while the tree is walked
    for k in kids:
        kill_tree(int(k))
    os.kill(pid, signal.SIGKILL)
