"""A small decoder-only transformer with mixture-of-experts feed-forward layers.

One file, top to bottom: helpers, attention, expert layer, block, config, model.
It knows nothing of islands, fragments or networks: the swarm protocols see it
only through `named_parameters()` and `layer_groups()`.

Shape suffixes: B batch, T time (sequence), D model width, H heads, K head
width, E experts, F expert hidden width, N tokens (B*T), V vocabulary (256 bytes).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB_SIZE = 256  # byte-level: no tokenizer, nothing to download


# --- helpers -----------------------------------------------------------------


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x.float()).type_as(x) * self.weight


# --- attention ---------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        assert d_model % n_head == 0
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        q, k, v = self.qkv(x_BTD).split(D, dim=-1)
        q_BHTK, k_BHTK, v_BHTK = (
            z.view(B, T, self.n_head, D // self.n_head).transpose(1, 2) for z in (q, k, v)
        )
        y_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTK, is_causal=True)
        return self.proj(y_BHTK.transpose(1, 2).reshape(B, T, D))


# --- expert layer ------------------------------------------------------------


class DenseFFN(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.down(F.gelu(self.up(x_BTD))), x_BTD.new_zeros(())


class MoEFFN(nn.Module):
    """Top-k routed experts (top-1 by default) with the Switch load-balancing loss.

    Experts are stored as two stacked weights so that an expert is one slice,
    and every token goes to its expert (no capacity, no dropped tokens).
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.w_up_EFD = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.w_down_EDF = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        nn.init.normal_(self.w_up_EFD, std=1.0 / math.sqrt(d_model))
        nn.init.normal_(self.w_down_EDF, std=1.0 / math.sqrt(d_ff))

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        probs_NE = self.router(x_ND).float().softmax(dim=-1)
        gate_NK, expert_NK = probs_NE.topk(self.top_k, dim=-1)
        if self.top_k > 1:
            gate_NK = gate_NK / gate_NK.sum(-1, keepdim=True)
        out_ND = torch.zeros_like(x_ND)
        flat_expert = expert_NK.flatten()
        order = flat_expert.argsort(stable=True)
        counts = torch.bincount(flat_expert, minlength=self.num_experts).tolist()
        token_of_slot = order // self.top_k
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            slots = order[start : start + count]
            tokens = token_of_slot[start : start + count]
            start += count
            h = F.gelu(x_ND[tokens] @ self.w_up_EFD[e].t())
            y = h @ self.w_down_EDF[e].t()
            gate = gate_NK.flatten()[slots].unsqueeze(-1).type_as(y)
            out_ND.index_add_(0, tokens, y * gate)
        # Switch Transformer auxiliary loss: E * sum_e (share of tokens routed to e) * (mean prob of e)
        share_E = torch.bincount(expert_NK[:, 0], minlength=self.num_experts).float() / (B * T)
        aux = self.num_experts * (share_E * probs_NE.mean(0)).sum()
        return out_ND.view(B, T, D), aux


# --- block -------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_head)
        self.ffn_norm = RMSNorm(cfg.d_model)
        if cfg.num_experts > 1:
            self.ffn = MoEFFN(cfg.d_model, cfg.d_ff, cfg.num_experts, cfg.top_k)
        else:
            self.ffn = DenseFFN(cfg.d_model, cfg.d_ff)

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD))
        y_BTD, aux = self.ffn(self.ffn_norm(x_BTD))
        return x_BTD + y_BTD, aux


# --- config ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    n_layer: int
    d_model: int
    n_head: int
    d_ff: int
    """Hidden width of each expert (or of the dense feed-forward layer)."""
    num_experts: int = 32
    """Experts per feed-forward layer; 1 means a dense model."""
    top_k: int = 1
    max_seq_len: int = 1024
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss in the training loss."""
    vocab_size: int = VOCAB_SIZE
    """256 for bytes; token data brings its tokenizer's size."""

    def __post_init__(self):
        for name in ("n_layer", "d_model", "n_head", "d_ff", "num_experts", "top_k", "max_seq_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"model d_model {self.d_model} is not divisible by n_head {self.n_head}")
        if self.top_k > self.num_experts:
            raise ValueError(f"model top_k {self.top_k} exceeds num_experts {self.num_experts}")

    def to_dict(self) -> dict:
        """As the run manifest holds it; a byte model's leaves out its vocabulary, as manifests did before token data."""
        out = dataclasses.asdict(self)
        if out["vocab_size"] == VOCAB_SIZE:
            del out["vocab_size"]
        return out


MODEL_SIZES: dict[str, ModelConfig] = {
    # tens of milliseconds a step on 2 CPU cores at batch 8 x 128 bytes
    "tiny": ModelConfig(n_layer=4, d_model=64, n_head=4, d_ff=128),
    # for one GPU
    "small": ModelConfig(n_layer=8, d_model=256, n_head=8, d_ff=512),
    "medium": ModelConfig(n_layer=12, d_model=512, n_head=8, d_ff=1024),
    "large": ModelConfig(n_layer=24, d_model=1024, n_head=16, d_ff=2048),
}


def model_config(size: str, *, dense: bool = False, vocab_size: int | None = None) -> ModelConfig:
    """The named size, as a mixture of experts or (dense=True) with one dense FFN per block, over
    bytes or (`vocab_size`) a tokenizer's ids."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model {size!r}; choose one of {', '.join(MODEL_SIZES)}")
    cfg = MODEL_SIZES[size]
    if dense:
        # a dense FFN as wide as the active expert compute: same FLOPs per token
        cfg = dataclasses.replace(cfg, num_experts=1, top_k=1, d_ff=cfg.d_ff * cfg.top_k)
    if vocab_size is not None:
        cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
    return cfg


# --- model -------------------------------------------------------------------


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.pos = nn.Parameter(torch.zeros(cfg.max_seq_len, cfg.d_model))
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith(("qkv.weight", "up.weight", "router.weight")):
                nn.init.normal_(p, std=1.0 / math.sqrt(cfg.d_model))
            elif name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))
        nn.init.zeros_(self.head.weight)

    def layer_groups(self) -> dict[str, str | int]:
        """Where each parameter sits by depth: "embed", a block index, or "head"."""
        groups: dict[str, str | int] = {}
        for name, _ in self.named_parameters():
            if name.startswith("blocks."):
                groups[name] = int(name.split(".")[1])
            elif name.startswith(("embed.", "pos")):
                groups[name] = "embed"
            else:
                groups[name] = "head"
        return groups

    def forward(
        self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Logits, the next-byte cross-entropy (if targets are given) and the load-balancing loss."""
        B, T = idx_BT.shape
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {T} exceeds max_seq_len {self.cfg.max_seq_len}")
        x_BTD = self.embed(idx_BT) + self.pos[:T]
        aux = x_BTD.new_zeros(())
        for block in self.blocks:
            x_BTD, block_aux = block(x_BTD)
            aux = aux + block_aux
        logits_BTV = self.head(self.norm(x_BTD))
        loss = None
        if targets_BT is not None:
            loss = F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten())
        return logits_BTV, loss, aux / self.cfg.n_layer
