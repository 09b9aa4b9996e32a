"""torchrun for the tests of Megatron-LM's pretrain_gpt.py, with the imports paid once per session.

    python tests/fork_torchrun.py --serve SOCKET pretrain_gpt.py

run in the checkout (cwd), as `python -m torch.distributed.run` is run there. A fresh rank spends
~5 s of CPU importing torch, megatron-core, Megatron-LM's training side and the plugin, before it
does anything; a 4-rank run on 2 cores is ~14 s, ~10 s of it those imports. Here one process (a
zygote, kept for the test session) imports what the script imports at its top level (and the
plugin's Megatron-LM hooks). Each request on the Unix socket (a JSON line: argv, nproc, port, cwd,
env, the output file) is run by a forked copy of it, with its output in the file, which forks the
ranks; each runs the script as `__main__` (runpy) with torchrun's environment (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and exits through the interpreter's own
shutdown, as a process started by torchrun does. As torchrun does, the first rank that fails ends
the others (SIGTERM, then SIGKILL) and the run exits 1. The reply is the copy's pid, then its exit
code. The tests start one zygote per checkout and environment (tests/megatron_lm_run.py), so a run
costs its ranks' work only. The zygote leaves when its parent (the test process) is gone.

What differs from a fresh process: an import-time warning shows once (in the launcher), not once
per rank; a process a rank spawns with multiprocessing does not import the script, and in a run
with --save megatron-core's torch_dist writer gets its results queue from a forked Manager made as
the rank starts, not a spawned one at its first save (both: below). Nothing runs in the launcher
but imports (no thread, no tensor op: fork must find the process idle). HETERMOE_TESTS_TORCHRUN=1
makes the tests use torch.distributed.run instead.
"""
from __future__ import annotations

import argparse
import ast
import ctypes
import importlib
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback

PLUGIN_HOOKS = ("megatron_hetermoe.megatron_lm", "megatron_hetermoe.megatron_lm.hooks")


def top_level_modules(script: str) -> list[str]:
    """The modules `script` imports at its top level (not under `if __name__ == "__main__"`), and
    the submodules named in its `from package import name` lines that are modules."""
    with open(script) as f:
        tree = ast.parse(f.read(), script)
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def preload(script: str) -> None:
    for name in [*top_level_modules(script), *PLUGIN_HOOKS]:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # a name imported from a module (a function), or an optional import the script guards


def _die_with_parent() -> None:
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _spawn_without_main() -> None:
    """Processes this rank starts with multiprocessing's "spawn" do not import the script.

    megatron-core's torch_dist writer starts a spawned Manager for its results queue at a rank's first
    save (filesystem_async._get_write_results_queue). A spawned child imports the parent's __main__,
    here pretrain_gpt.py and with it Megatron-LM's training side: ~9 s of a 4-rank run on 2 cores,
    once per run that saves. The Manager's server needs nothing of the script (what it unpickles
    comes from importable modules), so a missing attribute would fail loudly, never differ."""
    import multiprocessing.spawn as mp_spawn

    prepare = mp_spawn.get_preparation_data

    def preparation_data(name):
        data = prepare(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    mp_spawn.get_preparation_data = preparation_data


def _warm_checkpoint_queue() -> None:
    """megatron-core's results queue of the torch_dist writer, made before the script runs, from a
    forked Manager (this rank is single-threaded here) instead of the spawned one its first save
    starts: that one imports torch to unpickle the writers' results, ~4 s of a 4-rank run on 2 cores.
    The same Manager queue; only how its server process starts differs."""
    from multiprocessing import get_context
    from multiprocessing.managers import SyncManager

    mod = sys.modules.get("megatron.core.dist_checkpointing.strategies.filesystem_async")
    if mod is None or getattr(mod, "_results_queue", False) is not None:
        return  # another megatron-core than this harness knows: its own way
    manager = SyncManager(ctx=get_context("fork"))
    manager.start(_die_with_parent)  # shut down at the rank's exit (multiprocessing's finalizer), or with it
    mod._results_queue = manager.Queue()


def run_rank(rank: int, world: int, port: int, script: str, argv: list[str]) -> None:
    """In the forked child: torchrun's environment, the script as __main__, then SystemExit with its
    code (the interpreter's shutdown runs: non-daemon threads joined, atexit handlers)."""
    _die_with_parent()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.stdout.reconfigure(line_buffering=True)  # torchrun starts its ranks with python -u
    sys.stderr.reconfigure(line_buffering=True)
    sys.argv = [script, *argv]
    _spawn_without_main()
    if "--save" in argv:  # only a run that saves writes checkpoints through that queue
        _warm_checkpoint_queue()
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - shown as an uncaught exception would be
        traceback.print_exc()
        code = 1
    raise SystemExit(code)


def wait_ranks(pids: dict[int, int], grace_s: float = 10.0) -> int:
    """Wait for every rank; at the first failure, end the others as torchrun does."""
    failed: tuple[int, int] | None = None
    deadline = None
    while pids:
        if deadline is None:
            pid, status = os.waitpid(-1, 0)
        else:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if time.monotonic() > deadline:
                    for p in pids:
                        os.kill(p, signal.SIGKILL)
                    deadline = float("inf")
                time.sleep(0.05)
                continue
        rank = pids.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and failed is None:
            failed = (rank, code)
            for p in pids:
                os.kill(p, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
    if failed is None:
        return 0
    rank, code = failed
    what = f"signal {-code}" if code < 0 else f"exit code {code}"
    print(f"fork_torchrun: rank {rank} failed first ({what}); the other ranks were ended", file=sys.stderr)
    return 1


def launch(script: str, argv: list[str], nproc: int, port: int) -> int:
    """Fork `nproc` ranks of `script` (in the zygote's copy, whose imports are done) and wait for them."""
    if threading.active_count() > 1:
        raise SystemExit(f"fork_torchrun: {threading.active_count()} threads after the imports; forking would "
                         f"copy a busy process (set HETERMOE_TESTS_TORCHRUN=1 to use torchrun)")
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            run_rank(rank, nproc, port, script, argv)  # never returns
        pids[pid] = rank

    def forward(signum, frame):
        for pid in pids:
            os.kill(pid, signum)

    signal.signal(signal.SIGTERM, forward)
    return wait_ranks(pids)


def _serve_one(req: dict) -> None:
    """In the zygote's forked copy: the request's cwd, environment and output file, its ranks, then
    exit with their code (os._exit: the zygote's own exit handlers are not this run's)."""
    _die_with_parent()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    fd = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    code = launch(req["argv"][0], req["argv"][1:], req["nproc"], req["port"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(path: str, script: str) -> int:
    """The zygote: import once, then one forked run per request (one at a time, as tests run)."""
    preload(script)
    parent = os.getppid()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path + ".part")
    srv.listen(4)
    os.rename(path + ".part", path)  # the client waits for this name: it appears once the imports are done
    srv.settimeout(1.0)
    while True:
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            if os.getppid() != parent:  # the test process is gone
                return 0
            continue
        conn.settimeout(None)
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(1 << 16)
            if not chunk:
                break
            data += chunk
        req = json.loads(data)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            srv.close()
            conn.close()
            _serve_one(req)  # never returns, but through its ranks' SystemExit
        conn.sendall(f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        try:
            conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
        except OSError:
            pass  # the client gave up (its timeout) and killed the run
        conn.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve", metavar="SOCKET", required=True, help="the zygote's Unix socket")
    p.add_argument("script")
    a = p.parse_args()
    sys.path[0] = os.getcwd()  # the script's directory, as `python pretrain_gpt.py` has it (not tests/)
    return serve(a.serve, a.script)


if __name__ == "__main__":
    sys.exit(main())
