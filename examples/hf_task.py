"""A task whose model compute-islands does not ship: a Hugging Face causal LM, built from a config dict.

    pip install 'compute-islands[hf]'
    islands-node --task examples.hf_task:build --task-arg arch=llama --steps 200 --window 20 --fragments 2

Every island calls `build(ctx)` on each of its ranks. The model is a small Llama (or, with
`--task-arg arch=mixtral`, a Mixtral-style mixture of experts) made from a config dict: nothing is
downloaded. The data are the project's byte corpus (the Python standard library's source) or token
shards (`--task-arg data=tokens:/data/*.bin --task-arg vocab=50304`); a batch is a pure function of
the run's seed, the island's shard, this rank and the task's data position, and the position is the
task's checkpointed state, so a resumed island reads on where it stopped.
"""

from __future__ import annotations

import hashlib

import torch
from islands.models.data import DataConfig, load_corpus
from islands.node import StepResult, Task, TaskContext

ARCHS = {
    "llama": {"model_type": "llama"},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 1},
}
EVAL_SEED, EVAL_BATCHES = 12345, 4


def model_config(arch: str, vocab: int, d_model: int, layers: int, seq_len: int):
    from transformers import AutoConfig

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    spec = {
        **ARCHS[arch], "vocab_size": vocab, "hidden_size": d_model, "intermediate_size": 4 * d_model if arch == "llama" else 2 * d_model,
        "num_hidden_layers": layers, "num_attention_heads": max(1, d_model // 32), "num_key_value_heads": max(1, d_model // 64),
        "max_position_embeddings": seq_len, "tie_word_embeddings": False,
    }
    model_type = spec.pop("model_type")
    return AutoConfig.for_model(model_type, **spec)


def build(ctx: TaskContext) -> Task:
    from transformers import AutoModelForCausalLM

    arch = ctx.arg("arch", "llama")
    seq_len = ctx.arg("seq_len", 128, int)
    batch_size = ctx.arg("batch_size", 8, int)
    data = ctx.arg("data", "stdlib")
    vocab = ctx.arg("vocab", 256, int)
    lr = ctx.arg("lr", 3e-3, float)
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32

    torch.manual_seed(ctx.seed)  # every island starts from the same model
    cfg = model_config(arch, vocab, ctx.arg("d_model", 128, int), ctx.arg("layers", 4, int), seq_len)
    model = AutoModelForCausalLM.from_config(cfg).to(ctx.device)
    net = ctx.parallelize(model)  # DDP or FSDP2 on a multi-rank island; the model itself on one rank
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)

    corpus = load_corpus(DataConfig(data=data, num_shards=ctx.num_shards), seq_len, vocab if data.startswith("tokens:") else None)
    shard = corpus.shard(ctx.shard)
    state = {"position": 0}  # batches read so far by each rank: the data position

    def train_step(step: int) -> StepResult:
        net.train()
        key = state["position"] * ctx.world + ctx.rank
        x, y = shard.batch(ctx.seed * 7919 + ctx.shard, key, batch_size, seq_len)
        x, y = x.to(ctx.device), y.to(ctx.device)
        with torch.autocast(ctx.device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = _loss(net, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["position"] += 1
        batch = hashlib.sha256(x.cpu().numpy().tobytes()).hexdigest()[:12]
        return StepResult(loss=loss.item(), tokens=x.numel(), info={"batch": batch, "position": state["position"]})

    @torch.no_grad()
    def evaluate() -> float:
        net.eval()
        losses = []
        for i in range(EVAL_BATCHES):
            x, y = corpus.eval.batch(EVAL_SEED, i, 8, seq_len)
            with torch.autocast(ctx.device.type, dtype=dtype, enabled=dtype != torch.float32):
                losses.append(_loss(net, x.to(ctx.device), y.to(ctx.device)).item())
        return sum(losses) / len(losses)

    return Task(
        model=model, optimizer=optimizer, train_step=train_step, evaluate=evaluate,
        state_dict=lambda: dict(state), load_state_dict=state.update,
    )


def _loss(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: `y` is `x` shifted by one already."""
    logits = net(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
