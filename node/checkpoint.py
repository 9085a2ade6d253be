"""Checkpoints in `<run-dir>/checkpoint/`, written atomically and checked on load.

Layout: `global.safetensors` (every fragment's agreed parameters, named as in
the model's state dict), `local.safetensors` (the model being trained),
`outer.safetensors` (outer Nesterov momentum, same names), `inner_opt.pt`
(the inner optimizer's state dict), `task.pt` (a task's own state, when it has
one: its data position, schedulers, RNG), `residual.safetensors` (the error
feedback's residuals, when there are any) and `state.json` (step, manifest,
per-fragment counters, totals, and the size and SHA-256 of every other file).

A save writes a complete new folder `checkpoint.new/`, then swaps it in with
two renames; a crash at any point leaves a complete old or new checkpoint,
which `load` finds. A checkpoint that is truncated, altered or of another run
is reported (CheckpointError) and left as it is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import io
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from islands.protocols.manifest import describe_differences, manifest_differences
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

FORMAT = 1
TENSOR_FILES = ("global.safetensors", "local.safetensors", "outer.safetensors")
OPT_FILE = "inner_opt.pt"
TASK_FILE = "task.pt"
RESIDUAL_FILE = "residual.safetensors"


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message says why and where."""


class ForeignCheckpoint(CheckpointError):
    """A sound checkpoint of another run or configuration (not to be set aside: the wrong --run-dir)."""


@dataclasses.dataclass
class Checkpoint:
    step: int
    manifest: dict
    global_state: dict[str, torch.Tensor]
    local_state: dict[str, torch.Tensor]
    outer_state: dict[str, torch.Tensor]
    inner_opt_state: dict
    fragments: list[dict]
    totals: dict[str, Any]
    inner_opt: str
    task_state: dict | None = None
    """A task's own state (Task.state_dict), or None."""
    residual_state: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """The error feedback's residuals by parameter name (StreamingDiLoCo.residual_state)."""


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoint"


def _fsync_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(run_dir: str | os.PathLike, ckpt: Checkpoint) -> Path:
    """Write `checkpoint/` anew: into `checkpoint.new`, then swapped in. OSError (a full disk)
    leaves the previous checkpoint as it was and no `checkpoint.new` behind."""
    final = checkpoint_dir(run_dir)
    new = final.with_name("checkpoint.new")
    try:
        return _save(final, new, ckpt)
    except OSError:
        if (final.exists() or final.with_name("checkpoint.old").exists()) and new.exists():
            shutil.rmtree(new, ignore_errors=True)
        raise


def _save(final: Path, new: Path, ckpt: Checkpoint) -> Path:
    old = final.with_name("checkpoint.old")
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir(parents=True, mode=0o700)
    blobs = {
        "global.safetensors": st_save(_contiguous(ckpt.global_state)),
        "local.safetensors": st_save(_contiguous(ckpt.local_state)),
        "outer.safetensors": st_save(_contiguous(ckpt.outer_state)),
    }
    buf = io.BytesIO()
    torch.save(ckpt.inner_opt_state, buf)
    blobs[OPT_FILE] = buf.getvalue()
    if ckpt.task_state is not None:
        buf = io.BytesIO()
        torch.save(ckpt.task_state, buf)
        blobs[TASK_FILE] = buf.getvalue()
    if ckpt.residual_state:
        blobs[RESIDUAL_FILE] = st_save(_contiguous(ckpt.residual_state))
    for name, data in blobs.items():
        _fsync_write(new / name, data)
    state = {
        "format": FORMAT,
        "step": ckpt.step,
        "manifest": ckpt.manifest,
        "inner_opt": ckpt.inner_opt,
        "fragments": ckpt.fragments,
        "totals": ckpt.totals,
        "files": {n: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in blobs.items()},
    }
    _fsync_write(new / "state.json", json.dumps(state, indent=1).encode())
    _fsync_dir(new)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    new.rename(final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
    return final


def _contiguous(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def recover(run_dir: str | os.PathLike) -> None:
    """Finish a swap that a crash interrupted: a complete new or old folder becomes `checkpoint/`."""
    final = checkpoint_dir(run_dir)
    if final.exists():
        return
    for candidate in (final.with_name("checkpoint.new"), final.with_name("checkpoint.old")):
        if (candidate / "state.json").exists():
            try:
                _read_state(candidate)
            except CheckpointError:
                continue
            candidate.rename(final)
            return


def _read_state(folder: Path) -> dict:
    where = str(folder)
    try:
        state = json.loads((folder / "state.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {where} has no state.json (incomplete or not a checkpoint)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {where}: state.json is truncated or corrupt ({e})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {where} is not a compute-islands checkpoint of format {FORMAT}")
    for key in ("step", "manifest", "fragments", "files", "totals", "inner_opt"):
        if key not in state:
            raise CheckpointError(f"checkpoint {where}: state.json lacks {key!r}")
    for name in _files(state):
        info = state["files"].get(name)
        path = folder / name
        if info is None or not path.exists():
            raise CheckpointError(f"checkpoint {where} lacks {name}")
        if path.stat().st_size != info["bytes"]:
            raise CheckpointError(
                f"checkpoint {where}: {name} is truncated ({path.stat().st_size} of {info['bytes']} bytes)"
            )
    return state


SAFE_GLOBAL_PREFIX = "pytorch_optimizer."


def _load_optimizer_state(data: bytes) -> dict:
    """torch.load with weights_only, allowing the plain state classes of pytorch-optimizer's Shampoo."""
    allowed = []
    for qualname in torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)):
        if not qualname.startswith(SAFE_GLOBAL_PREFIX):
            raise CheckpointError(f"{OPT_FILE} refers to {qualname}, which is not optimizer state")
        module, _, name = qualname.rpartition(".")
        allowed.append(getattr(importlib.import_module(module), name))
    with torch.serialization.safe_globals(allowed):
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def load(run_dir: str | os.PathLike, manifest: Mapping[str, Any]) -> Checkpoint | None:
    """The run dir's checkpoint, or None if it has none; CheckpointError if it is unusable or foreign."""
    recover(run_dir)
    folder = checkpoint_dir(run_dir)
    if not folder.exists():
        return None
    state = _read_state(folder)
    diffs = manifest_differences(dict(manifest), state["manifest"])
    if diffs:
        raise ForeignCheckpoint(
            f"checkpoint {folder} belongs to another run or configuration ("
            + describe_differences(diffs, mine="this node", theirs="the checkpoint")
            + "); use another --run-dir or the checkpoint's settings"
        )
    blobs = {}
    for name in _files(state):
        data = (folder / name).read_bytes()
        if hashlib.sha256(data).hexdigest() != state["files"][name]["sha256"]:
            raise CheckpointError(f"checkpoint {folder}: {name} is corrupt (checksum mismatch)")
        blobs[name] = data
    try:
        tensors = {name: st_load(blobs[name]) for name in TENSOR_FILES}
        opt_state = _load_optimizer_state(blobs[OPT_FILE])
        task_state = torch.load(io.BytesIO(blobs[TASK_FILE]), map_location="cpu", weights_only=True) if TASK_FILE in blobs else None
        residual_state = st_load(blobs[RESIDUAL_FILE]) if RESIDUAL_FILE in blobs else {}
    except Exception as e:  # a file that passed its checksum but does not parse
        raise CheckpointError(f"checkpoint {folder} cannot be read: {e}") from None
    return Checkpoint(
        step=int(state["step"]),
        manifest=state["manifest"],
        global_state=tensors["global.safetensors"],
        local_state=tensors["local.safetensors"],
        outer_state=tensors["outer.safetensors"],
        inner_opt_state=opt_state,
        fragments=state["fragments"],
        totals=state["totals"],
        inner_opt=state["inner_opt"],
        task_state=task_state,
        residual_state=residual_state,
    )


def set_aside(run_dir: str | os.PathLike) -> Path:
    """Move an unusable `checkpoint/` to `checkpoint.corrupt/` (replacing an older one), where an
    operator can still look at it; returns where it went."""
    folder = checkpoint_dir(run_dir)
    aside = folder.with_name("checkpoint.corrupt")
    shutil.rmtree(aside, ignore_errors=True)
    folder.rename(aside)
    return aside


def _files(state: dict) -> tuple[str, ...]:
    """The files a checkpoint holds (a task's state and residuals only where it has them)."""
    return (*TENSOR_FILES, OPT_FILE, *(f for f in (TASK_FILE, RESIDUAL_FILE) if f in state["files"]))


def peek_shard(run_dir: str | os.PathLike) -> int | None:
    """The data shard the run dir's checkpoint trained on, read before the checkpoint is checked
    (a task is built on its shard before its manifest exists); None without one."""
    recover(run_dir)
    try:
        shard = json.loads((checkpoint_dir(run_dir) / "state.json").read_text())["totals"]["shard"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return shard if isinstance(shard, int) and shard >= 0 else None
