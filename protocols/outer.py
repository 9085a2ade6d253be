"""The outer step of DiLoCo, on plain tensors: pseudo-gradient, weighting, Nesterov, mixing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def pseudo_gradient(global_: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """delta = global - local, in fp32 on global's device."""
    return global_ - local.detach().to(global_.device, torch.float32)


def token_weight(tokens_since_sync: int) -> float:
    """A contribution counts as much as the tokens it was trained on."""
    return float(max(0, tokens_since_sync))


def contribution_weight(tokens: int, staleness: int, satellite: bool = False) -> float:
    """The weight a contribution takes in its round.

    An island's delta counts its tokens. An island whose base is stale (it missed
    `staleness` rounds: it joined, restarted or was cut off) took its delta against
    values the swarm no longer has, so it counts 0 (the averager sends a tiny
    positive weight, which hivemind needs). A satellite is stale by design: its
    delta is its progress over the 1 + staleness windows since its last contact,
    about (1 + staleness) times an island's, so it counts tokens / (1 + staleness)**2:
    its accumulated progress moves the swarm as much as one window of an island with
    the same batch would, and its share of the group's weight shrinks with staleness.
    """
    base = token_weight(tokens)
    if staleness <= 0:
        return base
    return base / (1 + staleness) ** 2 if satellite else 0.0


def weighted_average(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum_i w_i * delta_i / sum_i w_i; the plain mean when all weights are zero."""
    if not deltas:
        raise ValueError("nothing to average")
    total = float(sum(weights))
    if total <= 0:
        return torch.stack(list(deltas)).mean(0)
    out = torch.zeros_like(deltas[0])
    for delta, w in zip(deltas, weights, strict=True):
        out.add_(delta, alpha=w / total)
    return out


def fold_deposits(
    delta: Mapping[str, torch.Tensor], weight: float, deposits: Sequence[tuple[Mapping[str, torch.Tensor], float]]
) -> tuple[dict[str, torch.Tensor], float]:
    """An island's contribution with satellites' deposited (delta, weight) pairs folded in: the
    weighted mean of all of them, with their summed weight, so that in the round each counts as
    if it had been a member itself. The island's own delta alone if all weights are zero."""
    weights = [weight, *(w for _, w in deposits)]
    total = float(sum(weights))
    if not deposits or total <= 0:
        return dict(delta), weight
    return {n: weighted_average([delta[n], *(d[n] for d, _ in deposits)], weights) for n in delta}, total


def nesterov_outer_step(
    global_: torch.Tensor, avg_delta: torch.Tensor, momentum: torch.Tensor, lr: float, mu: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGD with Nesterov momentum on the pseudo-gradient, as torch.optim.SGD(nesterov=True).

    m' = mu * m + delta;  global' = global - lr * (delta + mu * m').
    Returns (global', m') as new tensors.
    """
    new_momentum = momentum * mu + avg_delta
    new_global = global_ - lr * (avg_delta + mu * new_momentum)
    return new_global, new_momentum


def outer_hyper(round_: int, lr: float, mu: float, warmup: int) -> tuple[float, float]:
    """(learning rate, momentum) of the outer step of a fragment's round `round_` (the first is 1):
    with a warm-up of `warmup` rounds they go linearly from plain averaging (1, 0) at round 1 to
    (lr, mu) at round warmup + 1; without one, (lr, mu) throughout. Early in a run the replicas
    drift apart within a window, and averaging them plainly moves the model as far as their mean
    went; Nesterov's momentum, built on a few such steps, carries it past (bench/README.md)."""
    if warmup <= 0 or round_ > warmup:
        return lr, mu
    t = max(0, round_ - 1) / warmup
    return 1.0 + t * (lr - 1.0), t * mu


def mix(local: torch.Tensor, global_: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha * local + (1 - alpha) * global, in local's dtype and device (alpha = 0 replaces)."""
    g = global_.to(local.device, torch.float32)
    return (alpha * local.detach().float() + (1.0 - alpha) * g).to(local.dtype)
