"""Small files others poll for (a node's addresses, a relay's port): written whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


def write_lines(path: str | os.PathLike, lines: list[str]) -> None:
    """Atomically (a temporary file, then a rename), so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.rename(path)
