"""The run manifest: what every island of one run must agree on, and how two differ."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def build_manifest(run_id: str, model: Mapping[str, Any], diloco: Mapping[str, Any], layout_digest: str) -> dict:
    return {"run_id": run_id, "model": dict(model), **dict(diloco), "layout_digest": layout_digest}


def manifest_differences(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, my value, their value) for every field that differs; nested dicts as `model.d_model`."""
    out: list[tuple[str, Any, Any]] = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out.extend((f"{key}.{k}", x, y) for k, x, y in manifest_differences(a, b))
        elif a != b:
            out.append((key, a, b))
    return out


def describe_differences(diffs: list[tuple[str, Any, Any]], mine: str = "this node", theirs: str = "the run") -> str:
    return "; ".join(f"{field}: {mine} has {a!r}, {theirs} has {b!r}" for field, a, b in diffs)
