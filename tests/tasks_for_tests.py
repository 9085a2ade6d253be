"""Build functions for the Task API's tests: one that trains, and the ways a build can go wrong."""

import torch
from islands.node import StepResult, Task, TaskContext


class Stack(torch.nn.Module):
    def __init__(self, width: int = 8, depth: int = 4):
        super().__init__()
        self.embed = torch.nn.Linear(width, width)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def build(ctx: TaskContext) -> Task:
    """Regression on a fixed random linear target; the data position is the task's state."""
    torch.manual_seed(ctx.seed)
    model = Stack(depth=ctx.arg("depth", 4, int)).to(ctx.device)
    net = ctx.parallelize(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    target = torch.randn(8, generator=torch.Generator().manual_seed(99))
    state = {"position": 0}

    def batch(key: int):
        g = torch.Generator().manual_seed(key)
        x = torch.randn(16, 8, generator=g)
        return x, (x @ target).unsqueeze(1)

    def train_step(step: int) -> StepResult:
        x, y = batch(1000 * ctx.shard + state["position"] * ctx.world + ctx.rank)
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        state["position"] += 1
        return StepResult(loss=loss.item(), tokens=16)

    def evaluate() -> float:
        with torch.no_grad():
            x, y = batch(-1)
            return torch.nn.functional.mse_loss(net(x), y).item()

    return Task(model=model, optimizer=opt, train_step=train_step, evaluate=evaluate,
                state_dict=lambda: dict(state), load_state_dict=state.update)


def raises(ctx: TaskContext) -> Task:
    raise RuntimeError("no GPU quota left")


def not_a_task(ctx: TaskContext):
    return {"model": None}


not_callable = 3
