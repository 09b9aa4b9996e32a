"""--dry-run's launcher of CPU ranks: `python forkrun.py --nproc N (-m MODULE | SCRIPT) ARGS...`.

What torchrun does for the check's ranks, at a quarter of the CPU: this process imports torch,
megatron-core and the plugin once, then forks N ranks with torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each running rank.py's main
with the same arguments as under torchrun (the same per-rank environment and reports). The first
rank that fails ends the others, and its exit status is this process's. As the test suite starts
CPU ranks (DESIGN.md: fork after importing megatron); never on a GPU (CUDA does not survive a
fork), where the check uses torchrun itself.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] != "--nproc":
        print("usage: forkrun.py --nproc N (-m MODULE | SCRIPT) ARGS...", file=sys.stderr)
        return 2
    n, rest = int(argv[1]), argv[2:]
    import torch  # noqa: F401  - imported once, before the fork

    # What the entry point imports, from where it would import it: a script's own directory first
    # (Megatron-LM's tree holds megatron/), as `python SCRIPT` puts it on sys.path.
    if rest[0] != "-m":
        sys.path.insert(0, os.path.dirname(os.path.abspath(rest[0])))
    try:
        import megatron.core  # noqa: F401
        import megatron_hetermoe.training.hetero  # noqa: F401
        if rest[0] != "-m":
            import megatron.training  # noqa: F401
    except ImportError:  # the ranks report it, each
        pass
    if rest[0] != "-m":
        sys.path.pop(0)
    import rank

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(n),
           "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": "0", "ROLE_RANK": "0", "ROLE_WORLD_SIZE": str(n)}
    children = {}
    for r in range(n):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.environ.update(env, RANK=str(r), LOCAL_RANK=str(r), ROLE_RANK=str(r))
                code = rank.main(rest)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:  # noqa: BLE001 - shown, then the rank ends
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = r
    first_failure = 0
    while children:
        pid, status = os.wait()
        if pid not in children:
            continue
        r = children.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and first_failure == 0:
            first_failure = code if code > 0 else 128 - code
            print(f"forkrun: rank {r} exited with {code}; ending the other ranks", file=sys.stderr, flush=True)
            for other in children:
                try:
                    os.kill(other, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
    return first_failure


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
