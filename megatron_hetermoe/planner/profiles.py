"""GPU profiles: what the planner knows about one GPU type, and where each number comes from.

A profile is a YAML file in configs/gpus/. Every number is a `{value: X, source: "..."}` pair,
and the source starts with one of the tags in SOURCE_TAGS:
  datasheet   - a vendor's public peak (dense fp16 tensor TFLOPS, memory bandwidth, memory size)
  paper-ratio - derived from a ratio the HeterMoE paper measured (PAPER.md "Why")
  measured    - measured on this kind of device by `hetermoe profile`
  estimate    - our assumption; the source says what it is based on
Two kinds of timing information can be present:
  * analytic: datasheet peaks and efficiencies; the cost model runs a roofline over FLOPs/bytes.
  * measured: tables from `hetermoe profile` (time of attention+router per (seq_len, tokens) and
    of one expert per token count, for the profiled model shape); the cost model interpolates the
    achieved FLOP rate and scales by FLOPs to other shapes. Measured tables win when present.
A profile may instead give a speed *ratio* to another profile (`expert_speed_vs`,
`attention_speed_vs`), e.g. the paper's "V100 runs an expert at 80% of A40 speed"; the loader
turns the ratio into an efficiency, solving against the reference GPU with the same cost model.

Which program the numbers are for (cost_model.Program): analytic profiles describe the paper's
(fp16 mixed precision on tensor cores, fused attention, activation recompute), plus an fp32 peak
(`peak_fp32_tflops`, optional) for pricing fp32 programs; measured tables describe the program
`hetermoe profile` ran, recorded in measured.info.program (precision, attention kernel).

This module reads and writes the YAML; the data types (GpuProfile, MeasuredTables, LinkProfile,
ProfileError) live in gpu_profile.py.
"""
from __future__ import annotations

import dataclasses
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from megatron_hetermoe.paths import config_dir, read_yaml_mapping, resolve_config
from megatron_hetermoe.planner.cost_model import (
    calibrate_attention_efficiency,
    calibrate_gemm_efficiency,
)
from megatron_hetermoe.planner.gpu_profile import (
    AttentionSample,
    CommSample,
    ExpertSample,
    GpuProfile,
    LinkProfile,
    MeasuredTables,
    ProfileError,
)

SOURCE_TAGS = ("datasheet", "paper-ratio", "measured", "estimate")

# Numeric fields that a profile YAML must give as {value, source} (unless derived from a ratio).
_NUMERIC = (
    "memory_gib", "peak_fp16_tflops", "memory_bandwidth_gbs", "gemm_efficiency",
    "attention_core_efficiency", "launch_overhead_us", "intra_node_gbs", "link_latency_us",
    "usable_memory_fraction",
)
_OPTIONAL = ("peak_fp32_tflops",)  # {value, source} when present
_RATIO_FIELDS = {"expert_speed_vs": "gemm_efficiency", "attention_speed_vs": "attention_core_efficiency"}
# Fields that divide something (must be > 0), and fractions (must be in (0, 1]).
_POSITIVE = ("memory_gib", "peak_fp16_tflops", "peak_fp32_tflops", "memory_bandwidth_gbs", "intra_node_gbs")
_FRACTIONS = ("gemm_efficiency", "attention_core_efficiency", "usable_memory_fraction")


def _read_yaml(path: Path) -> dict:
    return read_yaml_mapping(path, "GPU profile", ProfileError)


def known_gpu_types() -> list[str]:
    """Names of the shipped profiles (configs/gpus/*.yaml, by the `name` inside each)."""
    out = []
    for p in sorted((config_dir() / "gpus").glob("*.yaml")):
        out.append(str(_read_yaml(p).get("name", p.stem)))
    return out


def _find_profile_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.is_file():  # not exists(): "" or a directory would pass and fail on read
        return p
    d = config_dir() / "gpus"
    for f in sorted(d.glob("*.yaml")):
        if f.stem.lower() == name_or_path.lower():
            return f
        if str(_read_yaml(f).get("name", "")).lower() == name_or_path.lower():
            return f
    try:
        return resolve_config(name_or_path, "gpus")
    except FileNotFoundError as e:  # the message lists the known names
        raise ProfileError(str(e)) from None


def _num(raw: dict, key: str, where: str) -> tuple[float, str]:
    v = raw.get(key)
    if not isinstance(v, dict) or "value" not in v or "source" not in v:
        raise ProfileError(f"{where}: field {key!r} must be {{value: NUMBER, source: 'TAG: note'}}, got {v!r}")
    src = str(v["source"])
    if src.split(":")[0].strip() not in SOURCE_TAGS:
        raise ProfileError(f"{where}: source of {key!r} is {src!r}; start it with one of {SOURCE_TAGS} and a colon")
    try:
        if isinstance(v["value"], bool):
            raise TypeError
        val = float(v["value"])
    except (TypeError, ValueError):
        raise ProfileError(f"{where}: value of {key!r} is {v['value']!r}, not a number") from None
    if not math.isfinite(val) or val < 0:
        raise ProfileError(f"{where}: value of {key!r} is {val}, must be a finite number >= 0")
    if key in _POSITIVE and val == 0:
        raise ProfileError(f"{where}: value of {key!r} is 0; it must be > 0")
    if key in _FRACTIONS and not 0 < val <= 1:
        raise ProfileError(f"{where}: value of {key!r} is {val}; a fraction must be in (0, 1]")
    return val, src


def _measured(raw: Any, where: str) -> MeasuredTables | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: measured must be a mapping (model, attention, expert, ...); "
                           f"regenerate it with `hetermoe profile`")
    try:
        att = tuple(AttentionSample(int(a["seq_len"]), int(a["tokens"]), float(a["fwd_s"]), float(a["bwd_s"]))
                    for a in raw.get("attention", []))
        exp = tuple(ExpertSample(int(e["tokens"]), float(e["fwd_s"]), float(e["bwd_s"])) for e in raw.get("expert", []))
        a2a = tuple(CommSample(int(c["nbytes"]), float(c["seconds"])) for c in raw.get("all_to_all", []))
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"{where}: malformed measured table ({type(e).__name__}: {e}); "
                           f"regenerate it with `hetermoe profile`") from None
    if not att or not exp:
        raise ProfileError(f"{where}: measured section needs non-empty attention and expert tables")
    if not isinstance(raw.get("model"), dict):
        raise ProfileError(f"{where}: measured section needs the profiled model shape under 'model'")
    times = [x for a in att for x in (a.fwd_s, a.bwd_s)] + [x for e in exp for x in (e.fwd_s, e.bwd_s)]
    counts = [x for a in att for x in (a.seq_len, a.tokens)] + [e.tokens for e in exp]
    if not all(math.isfinite(t) and t > 0 for t in times) or min(counts) < 1:
        raise ProfileError(f"{where}: measured tables need times > 0 and token counts >= 1; "
                           f"regenerate them with `hetermoe profile`")
    if not all(math.isfinite(c.seconds) and c.seconds >= 0 and c.nbytes >= 0 for c in a2a):
        raise ProfileError(f"{where}: measured all_to_all samples need nbytes >= 0 and seconds >= 0")
    if not isinstance(raw.get("info", {}), dict):
        raise ProfileError(f"{where}: measured.info must be a mapping")
    from megatron_hetermoe.config import ModelConfig

    try:  # the cost model rebuilds this shape to scale the tables
        ModelConfig(**raw["model"])
    except (TypeError, ValueError) as e:
        raise ProfileError(f"{where}: measured.model is not a valid model shape ({e})") from None
    return MeasuredTables(dict(raw["model"]), att, exp, a2a, dict(raw.get("info", {})))


def load_profile(name_or_path: str) -> GpuProfile:
    """Load a profile by GPU name (e.g. "A40"), file stem, or path; resolves speed ratios."""
    return _load(str(name_or_path), ())


@lru_cache(maxsize=None)
def _load_cached(path: str) -> GpuProfile:
    return _load_path(Path(path), ())


def _load(name_or_path: str, chain: tuple[str, ...]) -> GpuProfile:
    path = _find_profile_path(name_or_path)
    if not chain:
        return _load_cached(str(path.resolve()))
    return _load_path(path, chain)


def _load_path(path: Path, chain: tuple[str, ...]) -> GpuProfile:
    where = str(path)
    raw = _read_yaml(path)
    name = raw.get("name", path.stem)
    if not isinstance(name, str) or not name:
        raise ProfileError(f"{where}: name={name!r} must be the GPU type's name, e.g. A40")
    if name in chain:
        raise ProfileError(f"{where}: speed ratios form a cycle {' -> '.join(chain + (name,))}; break it")
    vals: dict[str, float] = {}
    sources: dict[str, str] = {}
    for key in _NUMERIC + _OPTIONAL:
        if key in raw:
            vals[key], sources[key] = _num(raw, key, where)
    for flag in ("fp16", "bf16", "flash_attention"):
        if not isinstance(raw.get(flag), bool):
            raise ProfileError(f"{where}: field {flag!r} must be true or false, got {raw.get(flag)!r}")
    ratios = {k: raw[k] for k in _RATIO_FIELDS if k in raw}
    missing = [k for k in _NUMERIC if k not in vals and k not in {_RATIO_FIELDS[r] for r in ratios}]
    if missing:
        raise ProfileError(f"{where}: missing field(s) {missing}; give each as {{value, source}}")
    device_name = raw.get("device_name")
    if device_name is not None and (not isinstance(device_name, str) or not device_name):
        raise ProfileError(f"{where}: device_name={device_name!r} must be a regular expression that "
                           f"torch.cuda.get_device_name() of this GPU type matches")
    prof = GpuProfile(
        name=name, fp16=raw["fp16"], bf16=raw["bf16"], flash_attention=raw["flash_attention"], device_name=device_name,
        sources=sources, measured=_measured(raw.get("measured"), where),
        **{k: vals.get(k, 0.0) for k in _NUMERIC + _OPTIONAL},
    )
    if ratios:
        prof = _resolve_ratios(prof, ratios, where, chain + (name,))
    return prof


def _resolve_ratios(prof: GpuProfile, ratios: dict, where: str, chain: tuple[str, ...]) -> GpuProfile:
    for key, spec in ratios.items():
        if not isinstance(spec, dict) or not {"gpu", "ratio", "source"} <= set(spec):
            raise ProfileError(f"{where}: {key} needs gpu, ratio and source (and seq_len for attention), got {spec!r}")
        ref = _load(str(spec["gpu"]), chain)
        try:
            ratio = float(spec["ratio"]) if not isinstance(spec["ratio"], bool) else math.nan
        except (TypeError, ValueError):
            ratio = math.nan
        if not math.isfinite(ratio) or ratio <= 0:
            raise ProfileError(f"{where}: {key}.ratio={spec['ratio']!r} must be a finite number > 0")
        src = str(spec["source"])
        if key == "expert_speed_vs":
            eff = calibrate_gemm_efficiency(prof, ref, ratio)
            if not 0 < eff <= 1:
                raise ProfileError(f"{where}: expert_speed_vs ratio {ratio} vs {ref.name} needs gemm_efficiency="
                                   f"{eff:.3g}, outside (0, 1]; check the ratio and peak_fp16_tflops")
            prof = dataclasses.replace(prof, gemm_efficiency=eff)
            field_name = "gemm_efficiency"
        else:
            seq = spec.get("seq_len", 0)
            if type(seq) is not int or seq <= 0:
                raise ProfileError(f"{where}: attention_speed_vs needs seq_len (the length the ratio was measured at)")
            try:
                eff = calibrate_attention_efficiency(prof, ref, ratio, seq)
            except ValueError as e:
                raise ProfileError(f"{where}: {e}") from None
            prof = dataclasses.replace(prof, attention_core_efficiency=eff)
            field_name = "attention_core_efficiency"
        prof.sources[field_name] = (f"{src} (solved: {field_name}={eff:.4f} so that {ref.name} / {prof.name} "
                                    f"time = {ratio})")
    return prof


def load_link_profile(path: str | Path) -> LinkProfile:
    where = str(path)
    raw = _read_yaml(Path(path))
    if raw.get("kind") != "gpu-pair":
        raise ProfileError(f"{where}: kind={raw.get('kind')!r}; a link profile has kind: gpu-pair "
                           f"(hetermoe profile --gpu-pair writes one)")
    vals, srcs = {}, {}
    for key in ("link_latency_us", "intra_node_gbs"):
        vals[key], srcs[key] = _num(raw, key, where)
        if not srcs[key].startswith("measured"):
            raise ProfileError(f"{where}: {key} must be measured (source 'measured: ...'), got {srcs[key]!r}")
    devices = raw.get("devices")
    if not (isinstance(devices, list) and len(devices) == 2 and all(isinstance(d, str) for d in devices)):
        raise ProfileError(f"{where}: devices must name the two devices, got {devices!r}")
    if raw.get("backend") not in ("gloo", "nccl"):
        raise ProfileError(f"{where}: backend={raw.get('backend')!r}; gloo or nccl")
    if raw.get("precision") not in ("fp32", "bf16", "fp16"):
        raise ProfileError(f"{where}: precision={raw.get('precision')!r}; fp32, bf16 or fp16")
    rows = raw.get("all_to_all")
    if not isinstance(rows, list) or not rows or not all(
            isinstance(r, dict) and {"nbytes", "peer_bytes", "seconds"} <= set(r) for r in rows):
        raise ProfileError(f"{where}: all_to_all must list {{nbytes, peer_bytes, seconds}} samples")
    if raw["backend"] == "gloo" and "CPU/gloo" not in srcs["intra_node_gbs"]:
        raise ProfileError(f"{where}: gloo numbers must say they are CPU/gloo in their source")
    return LinkProfile((devices[0], devices[1]), raw["backend"], raw["precision"], vals["link_latency_us"],
                       vals["intra_node_gbs"], srcs, tuple(rows), str(raw.get("note", "")))


def load_profiles(names: list[str] | set[str]) -> dict[str, GpuProfile]:
    return {n: load_profile(n) for n in sorted(set(names))}


def profile_to_yaml(prof_fields: dict, measured: dict | None) -> str:
    """YAML text for a profile dict (used by the profiler); keeps the key order given."""
    d = dict(prof_fields)
    if measured is not None:
        d["measured"] = measured
    return yaml.safe_dump(d, sort_keys=False, default_flow_style=None, width=110)
