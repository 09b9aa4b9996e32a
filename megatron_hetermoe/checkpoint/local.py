"""Megatron's non-persistent local checkpoints (--non-persistent-ckpt-type local) and their
--replication, for the plugin's trainers: a restart loses at most the iterations since the last
local save and reads no persistent checkpoint (issue 44 item 3).

Every --non-persistent-save-interval iterations a rank serializes its state (what a persistent
save writes for it: parameters, optimizer state, LR schedule, RNG) into host memory; that copy is
the only part the step waits for. A background thread then writes it into its node's store (a
directory under --non-persistent-local-ckpt-dir: a tmpfs such as /dev/shm is host memory that
outlives the process) and, with --replication, sends it over a gloo group of its own to the
--replication-factor - 1 ranks --replication-jump apart (rank n's copies on n+J, n+2J, ... modulo
the world: other nodes' ranks when J is the GPUs per node), which write it into theirs.

A start with --load (the elastic launcher gives it) restores from the newest local checkpoint that
is complete over the surviving nodes' stores and newer than the persistent one: the ranks list
their node's store, every file a node lacks is sent to it from a node that has it, and each node
assembles the persistent format in its store (each file checked against the sha256 taken when it
was saved), which the persistent loader reads, resharded onto a new plan where the layout changed.

Store: <dir>/<job>/<node>/g<generation>/iter_<N>/rank_<r>.pt and rank_<r>.json (the .json, written
after the .pt, marks it complete and carries the manifest's fields). Each start takes a generation
of its own, so files of a failed start never mix with a later one's.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_hetermoe.checkpoint.format import (
    CheckpointError,
    RankState,
    iter_dir_name,
    rank_file_name,
    rank_payload,
    sha256_file,
)
from megatron_hetermoe.config import LocalCheckpointConfig

# The node of every rank, comma-separated in rank order: set by the forked launcher from its
# inventory (the ranks of one host stand for several nodes there). NODE_ENV: this process's node
# (several torchrun agents on one host). Default: the host name.
NODES_ENV = "HETERMOE_RANK_NODES"
NODE_ENV = "HETERMOE_NODE"
# The job a store belongs to: a fresh id per elastic job of the forked launcher; else torchrun's
# run id (--rdzv-id), else SLURM's job id, else "default".
JOB_ENV = "HETERMOE_LOCAL_CKPT_JOB"
KEEP = 2  # snapshots of its own generation a rank keeps: the newest may be incomplete at a failure


def node_of(rank: int) -> str:
    if os.environ.get(NODE_ENV):
        return os.environ[NODE_ENV]
    nodes = [x.strip() for x in os.environ.get(NODES_ENV, "").split(",") if x.strip()]
    if not nodes:
        return socket.gethostname()
    if rank >= len(nodes):
        raise ValueError(f"${NODES_ENV}={os.environ[NODES_ENV]!r} names {len(nodes)} nodes, none for rank {rank}")
    return f"node{nodes[rank]}"


def job_of() -> str:
    for k in (JOB_ENV, "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        if os.environ.get(k):
            return os.environ[k]
    return "default"


def job_store(cfg: LocalCheckpointConfig) -> Path:
    return Path(cfg.directory) / job_of()


def replica_holders(rank: int, world: int, cfg: LocalCheckpointConfig) -> list[int]:
    """The ranks that keep a copy of `rank`'s local checkpoint: rank + k*jump (mod world), k < factor."""
    if cfg.replication_jump is None:
        return []
    out: list[int] = []
    for k in range(1, cfg.replication_factor):
        h = (rank + k * cfg.replication_jump) % world
        if h != rank and h not in out:
            out.append(h)
    return out


def replica_sources(rank: int, world: int, cfg: LocalCheckpointConfig) -> list[int]:
    """The ranks whose copies `rank` keeps."""
    return [s for s in range(world) if rank in replica_holders(s, world, cfg)]


def scan(node_dir: Path) -> dict[tuple[int, int], dict]:
    """{(generation, iteration): {"world_size": W, "ranks": [...]}}: the complete rank files in a node's store."""
    out: dict[tuple[int, int], dict] = {}
    for meta in node_dir.glob("g*/iter_*/rank_*.json"):
        try:
            g, it = int(meta.parent.parent.name[1:]), int(meta.parent.name.split("_")[1])
            m = json.loads(meta.read_text())
        except (ValueError, OSError, json.JSONDecodeError):
            continue  # a partly written or foreign file: not a copy
        e = out.setdefault((g, it), {"world_size": m["world_size"], "ranks": []})
        e["ranks"].append(m["rank"])
    for e in out.values():
        e["ranks"].sort()
    return out


def newest_complete(stores: dict[str, dict[tuple[int, int], dict]]) -> tuple[int, int] | None:
    """The newest (generation, iteration) whose every rank file is in some store, by iteration
    (then generation); None when there is none."""
    union: dict[tuple[int, int], tuple[int, set[int]]] = {}
    for listing in stores.values():
        for key, e in listing.items():
            w, ranks = union.get(key, (e["world_size"], set()))
            union[key] = (w, ranks | set(e["ranks"]))
    done = [k for k, (w, ranks) in union.items() if ranks >= set(range(w))]
    return max(done, key=lambda k: (k[1], k[0]), default=None)


def _write(d: Path, rank: int, data: bytes, meta: dict) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, blob in ((f"rank_{rank}.pt", data), (f"rank_{rank}.json", json.dumps(meta).encode())):
        tmp = d / (name + ".tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, d / name)  # the .json last: its presence says the .pt is whole


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8,
                                                                                       device="cpu")


def assemble(snapshot: Path, iteration: int, out: Path) -> None:
    """The persistent format (rank files, manifest, tracker) of the local checkpoint in `snapshot`
    under `out`, its rank files hard links to the store's (no copy), each checked against the
    sha256 taken when it was saved."""
    from megatron_hetermoe.checkpoint.save import _publish

    shutil.rmtree(out, ignore_errors=True)
    tmp = out / (iter_dir_name(iteration) + ".tmp")
    tmp.mkdir(parents=True)
    files, manifest = {}, None
    for meta_path in sorted(snapshot.glob("rank_*.json")):
        meta = json.loads(meta_path.read_text())
        q = meta["rank"]
        rel = rank_file_name(q)
        dst = tmp / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(snapshot / f"rank_{q}.pt", dst)
        except OSError:
            shutil.copyfile(snapshot / f"rank_{q}.pt", dst)
        digest = sha256_file(dst)
        if digest != meta["sha256"]:
            raise CheckpointError(f"{snapshot / f'rank_{q}.pt'}: sha256 {digest[:12]}... differs from the one taken "
                                  f"at save, {meta['sha256'][:12]}...: the copy is damaged")
        files[rel] = {"rank": q, "role": meta["role"], "size": dst.stat().st_size, "sha256": digest,
                      "params": meta["params"]}
        manifest = manifest or meta["manifest"]
    if manifest is None:
        raise CheckpointError(f"{snapshot}: holds no rank file")
    _publish(out, iteration, {**manifest, "files": files})


@dataclass
class LocalStats:
    saves: int = 0
    bytes: int = 0
    serialize_s: float = 0.0  # the step waits for this
    background_s: float = 0.0  # write + replication, overlapped with the next steps
    waited_s: float = 0.0  # a save waiting for the previous one's background part


class LocalCheckpoints:
    """One rank's local checkpoints. Build it on every rank at the same point (it creates a gloo
    group), call begin() once at start, save() at step boundaries, finish() at the end."""

    def __init__(self, cfg: LocalCheckpointConfig, rank: int, world_size: int):
        import torch.distributed as dist

        self.cfg, self.rank, self.world = cfg, rank, world_size
        self.node = node_of(rank)
        self.store = job_store(cfg)
        self.node_dir = self.store / self.node
        self.holders = replica_holders(rank, world_size, cfg)
        self.sources = replica_sources(rank, world_size, cfg)
        # Its own group: the copies travel while the step's collectives run on the others.
        self.group = dist.new_group(ranks=list(range(world_size)), backend="gloo")
        self.generation = 0
        self.tags: list[str] = []
        self.stats = LocalStats()
        self._written: list[int] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # ---- start -------------------------------------------------------------------------------
    def begin(self, persistent: int | None, restore: bool) -> Path | None:
        """Collective: take this start's generation; with `restore`, the checkpoint directory (in
        this node's store) of the newest complete local checkpoint newer than the persistent
        iteration `persistent`, its missing files brought from other nodes; else None."""
        import torch.distributed as dist

        got: list = [None] * self.world
        dist.all_gather_object(got, (self.node, scan(self.node_dir)), group=self.group)
        self.tags = [t for t, _ in got]
        stores = {t: listing for t, listing in got}
        if self.rank == 0 and self.cfg.replication_jump is not None:
            alone = [r for r in range(self.world)
                     if all(self.tags[h] == self.tags[r] for h in replica_holders(r, self.world, self.cfg))]
            if alone:
                print(f" WARNING: --replication-jump {self.cfg.replication_jump} in a world of {self.world}: the "
                      f"local checkpoints of rank(s) {alone} have no copy on another node (a lost node loses "
                      f"them); give the GPUs per node as the jump", flush=True)
        self.generation = 1 + max((g for listing in stores.values() for g, _ in listing), default=0)
        best = newest_complete(stores) if restore else None
        if best is None or (persistent is not None and best[1] <= persistent):
            return None
        self._bring(stores, best)
        out = self.node_dir / "restore"
        error = None
        if self.rank == self.tags.index(self.node):  # one assembler per node
            try:
                assemble(self._dir(*best), best[1], out)
            except (CheckpointError, OSError, KeyError, ValueError) as e:
                error = f"local checkpoint of iteration {best[1]} on {self.node}: {e}"
        errors: list = [None] * self.world
        dist.all_gather_object(errors, error, group=self.group)
        bad = [e for e in errors if e]
        if bad:
            raise CheckpointError(bad[0] + "; remove the store " + str(self.store) + " to start from the persistent "
                                  "checkpoint")
        return out

    def _dir(self, generation: int, iteration: int) -> Path:
        return self.node_dir / f"g{generation}" / iter_dir_name(iteration)

    def _bring(self, stores: dict, best: tuple[int, int]) -> None:
        """Send every rank file of `best` to each node whose store lacks it (from the lowest rank
        of a node that has it to the lowest rank of the node without it), in one order on all ranks."""
        import torch.distributed as dist

        world = stores[next(t for t in stores if best in stores[t])][best]["world_size"]
        first = {t: self.tags.index(t) for t in stores}
        for q in range(world):
            have = sorted(t for t in stores if q in stores[t].get(best, {}).get("ranks", []))
            for t in sorted(stores):
                if t in have:
                    continue
                src, dst = first[have[0]], first[t]
                d = self._dir(*best)
                if self.rank == src:
                    data, meta = (d / f"rank_{q}.pt").read_bytes(), (d / f"rank_{q}.json").read_bytes()
                    head = torch.tensor([len(data), len(meta)], dtype=torch.int64, device="cpu")
                    dist.send(head, dst, group=self.group)
                    dist.send(_bytes_tensor(data), dst, group=self.group)
                    dist.send(_bytes_tensor(meta), dst, group=self.group)
                elif self.rank == dst:
                    head = torch.empty(2, dtype=torch.int64, device="cpu")
                    dist.recv(head, src, group=self.group)
                    data = torch.empty(int(head[0]), dtype=torch.uint8, device="cpu")
                    meta = torch.empty(int(head[1]), dtype=torch.uint8, device="cpu")
                    dist.recv(data, src, group=self.group)
                    dist.recv(meta, src, group=self.group)
                    _write(d, q, data.numpy().tobytes(), json.loads(meta.numpy().tobytes()))

    # ---- saving ------------------------------------------------------------------------------
    def save(self, state: RankState, iteration: int) -> None:
        """Serialize this rank's state now; write and replicate it in the background."""
        t0 = time.perf_counter()
        self.wait()
        t1 = time.perf_counter()
        buf = io.BytesIO()
        torch.save(rank_payload(state, iteration), buf)
        data = buf.getvalue()
        meta = {"rank": self.rank, "world_size": self.world, "iteration": iteration, "role": str(state.role),
                "params": {state.names[n]: list(p.shape) for n, p in state.module.named_parameters()},
                "manifest": {"trainer": state.trainer, "world_size": state.world_size, "model": state.model,
                             "layout": state.layout, "train": state.train}}
        self.stats.waited_s += t1 - t0
        self.stats.serialize_s += time.perf_counter() - t1
        self.stats.saves += 1
        self.stats.bytes = len(data)
        self._thread = threading.Thread(target=self._ship, args=(iteration, data, meta), daemon=True,
                                        name=f"local-ckpt-{iteration}")
        self._thread.start()

    def _ship(self, iteration: int, data: bytes, meta: dict) -> None:
        import torch.distributed as dist

        try:
            t0 = time.perf_counter()
            meta["sha256"] = hashlib.sha256(data).hexdigest()
            d = self._dir(self.generation, iteration)
            _write(d, self.rank, data, meta)
            if self.holders or self.sources:
                mine = json.dumps(meta).encode()

                def swap(out: torch.Tensor, into: dict[int, torch.Tensor]) -> None:
                    # one message each way per peer and phase: gloo matches them in order
                    reqs = [dist.isend(out, h, group=self.group) for h in self.holders]
                    reqs += [dist.irecv(t, s, group=self.group) for s, t in into.items()]
                    for r in reqs:
                        r.wait()

                heads = {s: torch.empty(2, dtype=torch.int64, device="cpu") for s in self.sources}
                swap(torch.tensor([len(data), len(mine)], dtype=torch.int64, device="cpu"), heads)
                bodies = {s: torch.empty(int(h[0]), dtype=torch.uint8, device="cpu") for s, h in heads.items()}
                notes = {s: torch.empty(int(h[1]), dtype=torch.uint8, device="cpu") for s, h in heads.items()}
                swap(_bytes_tensor(data), bodies)
                swap(_bytes_tensor(mine), notes)
                for s in self.sources:
                    _write(d, s, bodies[s].numpy().tobytes(), json.loads(notes[s].numpy().tobytes()))
            self._written.append(iteration)
            self._prune()
            self.stats.background_s += time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - raised in the training thread by wait()
            self._error = e

    def _prune(self) -> None:
        """Drop this rank's files of its older snapshots; at its third, the first rank of the node
        drops the other generations (the last start's copies: by then every rank has finished this
        start's first snapshot, the ranks moving in step)."""
        for it in self._written[:-KEEP]:
            d = self._dir(self.generation, it)
            for r in (self.rank, *self.sources):
                for suffix in (".json", ".pt"):  # the marker first
                    (d / f"rank_{r}{suffix}").unlink(missing_ok=True)
            try:
                d.rmdir()
            except OSError:
                pass  # other ranks' files are still there
        self._written = self._written[-KEEP:]
        if self.stats.saves == KEEP + 1 and self.tags and self.rank == self.tags.index(self.node):
            for old in self.node_dir.glob("g*"):
                if old.name != f"g{self.generation}":
                    shutil.rmtree(old, ignore_errors=True)
            shutil.rmtree(self.node_dir / "restore", ignore_errors=True)

    def wait(self) -> None:
        """Until the last save's background part is done; raises what it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError(f"local checkpoint of rank {self.rank}: {e}") from e

    def summary(self) -> str:
        s = self.stats
        n = max(s.saves, 1)
        return (f" local checkpoints: {s.saves} saved (every {self.cfg.interval} iteration(s)), "
                f"{s.bytes / 2**20:.1f} MiB per rank, copies on {len(self.holders)} other rank(s); per save: "
                f"serialize {s.serialize_s / n * 1e3:.1f} ms (the step waits), write + replicate "
                f"{s.background_s / n * 1e3:.1f} ms in the background, waited {s.waited_s / n * 1e3:.1f} ms "
                f"for the previous one (this rank)")
