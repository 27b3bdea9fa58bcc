"""horovodrun's --config-file (YAML; JSON also works) read into the same names as the command-line flags."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["load_config", "CONFIG_KEYS"]

# (section, key) in Horovod's config file -> argparse destination (and a converter).
CONFIG_KEYS: dict[tuple[str, str], str] = {
    ("params", "fusion_threshold_mb"): "fusion_threshold_mb",
    ("params", "cycle_time_ms"): "cycle_time_ms",
    ("params", "cache_capacity"): "cache_capacity",
    ("params", "hierarchical_allreduce"): "hierarchical_allreduce",
    ("params", "hierarchical_allgather"): "hierarchical_allgather",
    ("timeline", "filename"): "timeline_filename",
    ("timeline", "mark_cycles"): "timeline_mark_cycles",
    ("stall_check", "enabled"): "stall_check",
    ("stall_check", "warning_time_seconds"): "stall_check_warning_time_seconds",
    ("stall_check", "shutdown_time_seconds"): "stall_check_shutdown_time_seconds",
    ("logging", "level"): "log_level",
    ("autotune", "enabled"): "autotune",
    ("autotune", "log_file"): "autotune_log_file",
    ("autotune", "warmup_samples"): "autotune_warmup_samples",
    ("autotune", "steps_per_sample"): "autotune_steps_per_sample",
    ("autotune", "bayes_opt_max_samples"): "autotune_bayes_opt_max_samples",
    ("autotune", "gaussian_process_noise"): "autotune_gaussian_process_noise",
}


def _scalar(text: str) -> Any:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    lowered = text.lower()
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    for number in (int, float):
        try:
            return number(text)
        except ValueError:
            pass
    return text


def _parse_yaml_subset(text: str, path: str) -> dict[str, Any]:
    """Two-level 'section:' / '  key: value' YAML, which is all Horovod's config file uses."""
    result: dict[str, Any] = {}
    section: dict[str, Any] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        content = line.split(" #", 1)[0].rstrip()
        if not content.strip() or content.lstrip().startswith("#"):
            continue
        key, colon, value = content.strip().partition(":")
        if not colon:
            raise ValueError(f"config file {path}, line {number}: expected 'key: value', got {line.strip()!r}")
        if content[0] not in " \t":
            section = result.setdefault(key, {}) if not value.strip() else None
            if value.strip():
                result[key] = _scalar(value)
        elif section is None:
            raise ValueError(f"config file {path}, line {number}: indented {key!r} is not under a section")
        else:
            section[key] = _scalar(value)
    return result


def _read(path: str) -> object:  # JSON or YAML of any shape: load_config checks it
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read --config-file {path}: {exc.strerror}") from None
    if text.lstrip().startswith("{"):
        return json.loads(text)
    try:
        import yaml  # optional: full YAML when PyYAML is installed
    except ImportError:
        return _parse_yaml_subset(text, path)
    return yaml.safe_load(text) or {}


def load_config(path: str) -> dict[str, Any]:
    """Read a Horovod config file into {argparse destination: value}; unknown keys are an error."""
    data, values = _read(path), {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must be a mapping of sections, got {type(data).__name__}")
    for section, entries in data.items():
        if not isinstance(entries, dict):
            raise ValueError(f"config file {path}: section {section!r} must hold 'key: value' entries")
        for key, value in entries.items():
            if (section, key) not in CONFIG_KEYS:
                known = ", ".join(f"{s}.{k}" for s, k in CONFIG_KEYS)
                raise ValueError(f"config file {path}: {section}.{key} is not supported; known keys: {known}")
            values[CONFIG_KEYS[section, key]] = value
    return values
