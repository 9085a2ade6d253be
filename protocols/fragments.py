"""The strided fragment split: a pure function of the model's layer groups and P."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

Group = str | int  # "embed", a block index, or "head"


def split_fragments(groups: Mapping[str, Group], num_fragments: int) -> list[list[str]]:
    """Parameter names per fragment, in the order given.

    Block i goes to fragment i mod P; "embed" parameters to fragment 0; "head"
    parameters (final norm, output layer) to fragment P-1. Raises ValueError if
    some fragment would be empty (more fragments than blocks).
    """
    if num_fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {num_fragments}")
    fragments: list[list[str]] = [[] for _ in range(num_fragments)]
    for name, group in groups.items():
        if group == "embed":
            index = 0
        elif group == "head":
            index = num_fragments - 1
        elif isinstance(group, int) and group >= 0:
            index = group % num_fragments
        else:
            raise ValueError(f"parameter {name!r} has unknown layer group {group!r}")
        fragments[index].append(name)
    num_blocks = len({g for g in groups.values() if isinstance(g, int)})
    if num_blocks < num_fragments:
        raise ValueError(
            f"fragments {num_fragments} exceeds the model's {num_blocks} blocks: "
            f"use --fragments {num_blocks} or fewer"
        )
    return fragments


def layout_digest(fragments: Sequence[Sequence[str]], shapes: Mapping[str, Sequence[int]]) -> str:
    """A digest of which parameter (with which shape) sits in which fragment."""
    layout = [[[name, list(shapes[name])] for name in names] for names in fragments]
    return hashlib.sha256(json.dumps(layout, separators=(",", ":")).encode()).hexdigest()[:16]
