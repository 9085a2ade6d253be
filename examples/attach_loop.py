"""Example 2: your own PyTorch training loop, made an island of a swarm with `attach`.

    python examples/attach_loop.py --run-dir run-a                          # starts a swarm
    python examples/attach_loop.py --run-dir run-b --shard 1 --option join=/ip4/.../p2p/Qm...
    torchrun --nproc-per-node 2 examples/attach_loop.py --run-dir run-c    # an island of 2 DDP ranks
"""

import argparse
import os
import sysconfig
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from islands.node import attach


class TinyLM(nn.Module):
    """A byte-level causal transformer: parameters named embed/pos, layers.N..., norm, head."""

    def __init__(self, vocab=256, d=64, n_layers=4, seq_len=64):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(seq_len, d))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True) for _ in range(n_layers)
        )
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, x):
        h = self.embed(x) + self.pos[: x.size(1)]
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1))
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--shard", type=int, default=0, help="which part of the data this island reads")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--progress", default="auto", help="the island's progress: auto, bar, lines or off")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="any islands-node option, e.g. join=MADDR")
    args = ap.parse_args()

    torch.manual_seed(0)  # every island starts from the same model
    model, seq, batch, rank = TinyLM(), 64, 16, int(os.environ.get("RANK", "0"))
    net = model
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: the island's ranks share its work (DDP)
        torch.distributed.init_process_group("gloo")
        net = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.frombuffer(bytearray(Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_bytes()), dtype=torch.uint8).long()
    train, held_out = data[: int(len(data) * 0.9)], data[int(len(data) * 0.9) :]
    gen = torch.Generator().manual_seed(1000 + 100 * args.shard + rank)

    def sample(tokens, g):
        i = torch.randint(len(tokens) - seq - 1, (batch,), generator=g)
        return torch.stack([tokens[j : j + seq] for j in i]), torch.stack([tokens[j + 1 : j + seq + 1] for j in i])

    @torch.no_grad()
    def evaluate():
        x, y = sample(held_out, torch.Generator().manual_seed(0))
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()

    options = dict(kv.split("=", 1) for kv in args.option)
    island = attach(
        net, opt, run_dir=args.run_dir, steps=args.steps, progress=args.progress, window=20, fragments=2, evaluate=evaluate,
        state_dict=lambda: {"rng": gen.get_state()}, load_state_dict=lambda s: gen.set_state(s["rng"]), **options,
    )
    with island:  # leaves the swarm cleanly, with a checkpoint, however the loop ends
        for _ in range(island.start_step, island.steps):
            x, y = sample(train, gen)
            loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            island.step(tokens=x.numel(), loss=loss.item())  # this rank's tokens: rank 0 counts the island's


if __name__ == "__main__":
    main()
