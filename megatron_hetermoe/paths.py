"""Where the configs live: models/, gpus/ and clusters/ under one directory.

In order: the directory a user names (`hetermoe --config-dir DIR` or $HETERMOE_CONFIG_DIR), the
repository's configs/ when running from a checkout, else the copy shipped inside the installed
package (importlib.resources.files("megatron_hetermoe") / "configs", package data of the wheel).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

from megatron_hetermoe.errors import UserError

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR_ENV = "HETERMOE_CONFIG_DIR"
KINDS = ("models", "gpus", "clusters")


class ConfigNotFoundError(UserError, FileNotFoundError):
    """A config name or path that names no file; the message lists the known names."""


def shipped_config_dir() -> Path:
    """The configs installed with the package (may be absent in a checkout: see config_dir)."""
    from importlib.resources import files

    return Path(str(files("megatron_hetermoe") / "configs"))


@functools.lru_cache(maxsize=None)
def default_config_dir() -> Path:
    """The repository's configs/ when this module runs from a checkout (editable install or
    PYTHONPATH), else the package's own copy."""
    checkout = REPO_ROOT / "configs"
    if (REPO_ROOT / "setup.py").is_file() and (checkout / "models").is_dir():
        return checkout
    return shipped_config_dir()


def config_dir() -> Path:
    """The directory whose models/, gpus/ and clusters/ hold the configs named by NAME."""
    user = os.environ.get(CONFIG_DIR_ENV)
    return Path(user) if user else default_config_dir()


def set_config_dir(path: str | os.PathLike) -> Path:
    """Use `path` as the config directory for this process and the ranks it starts (through
    $HETERMOE_CONFIG_DIR, so forked and spawned ranks see it too)."""
    d = Path(path).expanduser().resolve()
    if not d.is_dir():
        raise FileNotFoundError(f"--config-dir {path}: not a directory; give a directory holding "
                                f"{', '.join(k + '/' for k in KINDS)} (like {default_config_dir()})")
    if not any((d / k).is_dir() for k in KINDS):
        raise FileNotFoundError(f"--config-dir {path}: has none of {', '.join(k + '/' for k in KINDS)}; "
                                f"copy {default_config_dir()} as a start")
    os.environ[CONFIG_DIR_ENV] = str(d)
    return d


def resolve_config(path_or_name: str, kind: str) -> Path:
    """A config file path, or a bare name looked up in <config dir>/<kind>/NAME.yaml."""
    p = Path(path_or_name)
    if p.is_file():  # not exists(): "" or a directory would pass and fail on read
        return p
    d = config_dir() / kind
    cand = d / f"{path_or_name.lower()}.yaml"
    if cand.exists():
        return cand
    known = sorted(f.stem for f in d.glob("*.yaml"))
    raise ConfigNotFoundError(
        f"{kind} config {path_or_name!r} not found: give a path to a YAML file or one of {known} "
        f"(from {d}; --config-dir or ${CONFIG_DIR_ENV} names another directory)"
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

