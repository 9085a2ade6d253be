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


def groups_by_name(names: Sequence[str]) -> dict[str, Group]:
    """Layer groups read from parameter names, in the model's order, for a model that does not say
    its own: the first dotted part of a name that is a number is its layer (`layers.3.`, `h.3.`,
    `blocks.3.`; an expert's index after it does not count). Names before the first layer are
    "embed", names after the last are "head", and a name without a number between two layers goes
    with the layer before it. Raises ValueError if no name holds a layer index."""
    layers: list[int | None] = [next((int(part) for part in name.split(".") if part.isdigit()), None) for name in names]
    indexed = [i for i, layer in enumerate(layers) if layer is not None]
    if not indexed:
        raise ValueError("no parameter name holds a layer index (like layers.3.): give the task its own fragment layout")
    first, last = indexed[0], indexed[-1]
    groups: dict[str, Group] = {}
    previous: int | None = None
    for i, (name, layer) in enumerate(zip(names, layers, strict=True)):
        if i < first:
            groups[name] = "embed"
        elif i > last:
            groups[name] = "head"
        else:
            previous = layer if layer is not None else previous
            groups[name] = previous
    return groups


def layout_digest(fragments: Sequence[Sequence[str]], shapes: Mapping[str, Sequence[int]]) -> str:
    """A digest of which parameter (with which shape) sits in which fragment."""
    layout = [[[name, list(shapes[name])] for name in names] for names in fragments]
    return hashlib.sha256(json.dumps(layout, separators=(",", ":")).encode()).hexdigest()[:16]
