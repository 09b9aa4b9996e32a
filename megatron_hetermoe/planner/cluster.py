"""A cluster: which GPU types, how many, how they sit in nodes, and the network between nodes.

configs/clusters/NAME.yaml:
    name: O1
    node_groups:               # ranks are numbered in this order, node by node
      - {gpu: A40, nodes: 1, gpus_per_node: 6, nic_gbps_per_gpu: 100}
      - {gpu: V100-16GB, nodes: 1, gpus_per_node: 6, nic_gbps_per_gpu: 100}
    network_latency_us: 10
    notes: "where the numbers come from"

Transfer model: a rank's bytes to ranks of its own node move at the GPU profile's
`intra_node_gbs`; bytes to other nodes at its NIC share (`nic_gbps_per_gpu`). Sending and
receiving are separate directions. A collective ends when its most loaded rank has pushed (and
pulled) all its bytes: t = latency + max over ranks of max(send_intra, send_inter, recv_intra,
recv_inter). This ignores switch congestion (non-blocking fabric assumed).
"""
from __future__ import annotations

import functools

import math
from dataclasses import dataclass
from pathlib import Path

from megatron_hetermoe.errors import UserError
from megatron_hetermoe.limits import MAX_RANKS
from megatron_hetermoe.paths import read_yaml, resolve_config
from megatron_hetermoe.planner.gpu_profile import GpuProfile


class ClusterError(UserError, ValueError):
    """A cluster file that cannot be used; the message names the bad value and the fix."""


def _count(g: dict, key: str, path) -> int:
    v = g[key]
    if type(v) is not int or v < 1:  # bool is an int subclass; 1.5 nodes is a typo
        raise ClusterError(f"{path}: node group {g.get('gpu')!r}: {key}={v!r} must be an integer >= 1")
    return v


def _positive(v, what: str, path, allow_zero: bool = False) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        x = math.nan
    if isinstance(v, bool) or not math.isfinite(x) or x < 0 or (x == 0 and not allow_zero):
        raise ClusterError(f"{path}: {what}={v!r} must be a finite number {'>= 0' if allow_zero else '> 0'}")
    return x


@dataclass(frozen=True)
class NodeGroup:
    gpu: str
    nodes: int
    gpus_per_node: int
    nic_gbps_per_gpu: float

    @property
    def count(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Cluster:
    name: str
    node_groups: tuple[NodeGroup, ...]
    network_latency_us: float = 10.0
    notes: str = ""

    @classmethod
    def load(cls, path_or_name: str | Path) -> "Cluster":
        from megatron_hetermoe.planner.profiles import known_gpu_types

        path = resolve_config(str(path_or_name), "clusters")
        raw = read_yaml(path, ClusterError)
        if not isinstance(raw, dict) or not isinstance(raw.get("node_groups"), list) or not raw["node_groups"]:
            raise ClusterError(f"{path}: a cluster is a YAML mapping with a non-empty node_groups list "
                               f"(see configs/clusters/o1.yaml)")
        known = {k.lower() for k in known_gpu_types()}
        groups = []
        for g in raw["node_groups"]:
            try:
                gpu = g["gpu"]
                if not isinstance(gpu, str) or (gpu.lower() not in known and not Path(gpu).is_file()):
                    raise ClusterError(f"{path}: node group gpu={gpu!r} has no profile; use one of "
                                       f"{sorted(known_gpu_types())} or add configs/gpus/NAME.yaml")
                groups.append(NodeGroup(gpu, _count(g, "nodes", path), _count(g, "gpus_per_node", path),
                                        _positive(g["nic_gbps_per_gpu"], "nic_gbps_per_gpu", path)))
            except (KeyError, TypeError) as e:
                raise ClusterError(f"{path}: node_groups entries need gpu, nodes, gpus_per_node, nic_gbps_per_gpu "
                                   f"({type(e).__name__}: {e})") from None
        total = sum(g.count for g in groups)
        if total > MAX_RANKS:  # a typo (nodes: 1e9) must not eat memory
            raise ClusterError(f"{path}: {total} GPUs in all; at most {MAX_RANKS} are supported (check nodes)")
        return cls(str(raw.get("name", path.stem)), tuple(groups),
                   _positive(raw.get("network_latency_us", 10.0), "network_latency_us", path, allow_zero=True),
                   str(raw.get("notes", "")))

    @classmethod
    def of(cls, name: str, counts: dict[str, int], nic_gbps: float = 100.0, gpus_per_node: int = 8) -> "Cluster":
        """A cluster built in code: `counts` GPUs of each type, packed into nodes of gpus_per_node."""
        groups = []
        for gpu, n in counts.items():
            full, rest = divmod(n, gpus_per_node)
            if full:
                groups.append(NodeGroup(gpu, full, gpus_per_node, nic_gbps))
            if rest:
                groups.append(NodeGroup(gpu, 1, rest, nic_gbps))
        return cls(name, tuple(groups))

    @classmethod
    def from_gpu_types(cls, name: str, gpu_types: list[str], nic_gbps: float = 100.0,
                       gpus_per_node: int = 8) -> "Cluster":
        """Nodes of consecutive ranks of one type (at most gpus_per_node each), in rank order."""
        groups: list[NodeGroup] = []
        i = 0
        while i < len(gpu_types):
            j = i
            while j < len(gpu_types) and gpu_types[j] == gpu_types[i] and j - i < gpus_per_node:
                j += 1
            groups.append(NodeGroup(gpu_types[i], 1, j - i, nic_gbps))
            i = j
        return cls(name, tuple(groups))

    # ---- rank views (rank order = node_groups order) ----------------------------------
    @property
    def world_size(self) -> int:
        return sum(g.count for g in self.node_groups)

    def gpu_types(self) -> list[str]:
        return [g.gpu for g in self.node_groups for _ in range(g.count)]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for g in self.node_groups:
            out[g.gpu] = out.get(g.gpu, 0) + g.count
        return out

    def node_of(self) -> list[int]:
        out, node = [], 0
        for g in self.node_groups:
            for _ in range(g.nodes):
                out += [node] * g.gpus_per_node
                node += 1
        return out

    def nic_gbs(self) -> list[float]:
        """Per-rank NIC bandwidth in GB/s."""
        return [g.nic_gbps_per_gpu / 8.0 for g in self.node_groups for _ in range(g.count)]

    def ranks_of(self, gpu: str) -> list[int]:
        return [r for r, t in enumerate(self.gpu_types()) if t == gpu]


@functools.lru_cache(maxsize=8)
def _rank_tables(cluster: Cluster) -> tuple[tuple[str, ...], tuple[int, ...], tuple[float, ...]]:
    """(GPU type, node, NIC GB/s) of every rank, made once per cluster: the search asks for links
    thousands of times, each over a few ranks of a cluster of thousands."""
    return tuple(cluster.gpu_types()), tuple(cluster.node_of()), tuple(cluster.nic_gbs())


@dataclass(frozen=True)
class Links:
    """Per-rank link speeds for a set of ranks (GB/s), used by the transfer model."""

    node: tuple[int, ...]
    intra_gbs: tuple[float, ...]
    inter_gbs: tuple[float, ...]
    latency_s: float

    @classmethod
    def for_ranks(cls, cluster: Cluster, ranks: list[int], profiles: dict[str, GpuProfile]) -> "Links":
        types, nodes, nics = _rank_tables(cluster)
        intra = tuple(profiles[types[r]].intra_node_gbs for r in ranks)
        lat = cluster.network_latency_us * 1e-6 + max(profiles[types[r]].link_latency_us for r in ranks) * 1e-6
        return cls(tuple(nodes[r] for r in ranks), intra, tuple(nics[r] for r in ranks), lat)


def collective_time(links: Links, nbytes: list[list[float]]) -> float:
    """Seconds of one all-to-all where rank i (index into `links`) sends nbytes[i][j] to rank j."""
    n = len(nbytes)
    send_i = [0.0] * n
    send_x = [0.0] * n
    recv_i = [0.0] * n
    recv_x = [0.0] * n
    any_bytes = False
    for i in range(n):
        row = nbytes[i]
        for j in range(n):
            b = row[j]
            if b <= 0 or i == j:
                continue
            any_bytes = True
            if links.node[i] == links.node[j]:
                send_i[i] += b
                recv_i[j] += b
            else:
                send_x[i] += b
                recv_x[j] += b
    if not any_bytes:
        return 0.0
    worst = 0.0
    for i in range(n):
        worst = max(worst, send_i[i] / (links.intra_gbs[i] * 1e9), recv_i[i] / (links.intra_gbs[i] * 1e9),
                    send_x[i] / (links.inter_gbs[i] * 1e9), recv_x[i] / (links.inter_gbs[i] * 1e9))
    return links.latency_s + worst


def transfer_time(cluster: Cluster, profiles: dict[str, GpuProfile], src: int, dst: int, nbytes: float) -> float:
    """Seconds to move `nbytes` from rank src to rank dst of `cluster` (point to point)."""
    links = Links.for_ranks(cluster, [src, dst], profiles)
    return collective_time(links, [[0.0, nbytes], [0.0, 0.0]])


def rank1_collective_time(links: Links, s: list[float], w: list[float], c: float) -> float:
    """`collective_time` for the bipartite all-to-alls of MoE, where rank i sends c*s[i]*w[j]
    bytes to rank j (e.g. s = tokens of each attention rank, w = fraction of the layer's experts
    each rank holds). O(n) instead of O(n^2), same result."""
    tot_s, tot_w = sum(s), sum(w)
    node_s: dict[int, float] = {}
    node_w: dict[int, float] = {}
    for nd, si, wi in zip(links.node, s, w):
        node_s[nd] = node_s.get(nd, 0.0) + si
        node_w[nd] = node_w.get(nd, 0.0) + wi
    # the worst of each rank's intra- and inter-node seconds; `b if b > a else a` is max(a, b)
    # without its call (this loop prices every collective the search simulates)
    worst = 0.0
    for nd, si, wi, intra, inter in zip(links.node, s, w, links.intra_gbs, links.inter_gbs):
        a, b = c * si * (node_w[nd] - wi), c * wi * (node_s[nd] - si)  # send, receive
        t_intra = (b if b > a else a) / (intra * 1e9)
        a, b = c * si * (tot_w - node_w[nd]), c * wi * (tot_s - node_s[nd])
        t_inter = (b if b > a else a) / (inter * 1e9)
        if t_intra > worst:
            worst = t_intra
        if t_inter > worst:
            worst = t_inter
    return links.latency_s + worst if worst > 0 else 0.0


def allreduce_time(links: Links, nbytes: float) -> float:
    """All-reduce of `nbytes` over the ranks of `links`: bandwidth term of a ring (each rank
    moves 2(n-1)/n of the data over the slowest link; inter-node if the ranks span nodes),
    latency term of a tree (2 log2 n steps), as NCCL picks per size."""
    n = len(links.node)
    if n <= 1 or nbytes <= 0:
        return 0.0
    multi_node = len(set(links.node)) > 1
    bw = min(links.inter_gbs) if multi_node else min(links.intra_gbs)
    return 2 * math.log2(n) * links.latency_s + 2.0 * (n - 1) / n * nbytes / (bw * 1e9)
