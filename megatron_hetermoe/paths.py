"""Where the shipped configs live (configs/ at the repository root, or $HETERMOE_CONFIG_DIR)."""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def config_dir() -> Path:
    return Path(os.environ.get("HETERMOE_CONFIG_DIR", REPO_ROOT / "configs"))


def resolve_config(path_or_name: str, kind: str) -> Path:
    """A config file path, or a bare name looked up in configs/<kind>/NAME.yaml."""
    p = Path(path_or_name)
    if p.is_file():  # not exists(): "" or a directory would pass and fail on read
        return p
    cand = config_dir() / kind / f"{path_or_name.lower()}.yaml"
    if cand.exists():
        return cand
    known = sorted(f.stem for f in (config_dir() / kind).glob("*.yaml"))
    raise FileNotFoundError(
        f"{kind} config {path_or_name!r} not found: give a path to a YAML file or one of {known}"
    )


def read_yaml(path: Path, error: type[Exception]):
    """The parsed YAML file (None for an empty one); `error` names the file when it is not YAML."""
    import yaml

    try:
        return yaml.safe_load(Path(path).read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid YAML ({e})") from None


def read_yaml_mapping(path: Path, what: str, error: type[Exception]) -> dict:
    """A YAML file holding a mapping of fields (an empty file is an empty mapping)."""
    raw = read_yaml(path, error)
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise error(f"{path}: a {what} is a YAML mapping of fields, got {type(raw).__name__}")
    return raw

