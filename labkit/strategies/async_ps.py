"""An asynchronous parameter server over plain gloo point-to-point messages.

Rank 0 holds the parameters and the optimizer; ranks 1..N-1 are workers. A worker pushes the
gradient it computed on the parameters of server version v and gets back the server's current
parameters, with no barrier: the server answers whoever's message arrives first, so a slow
worker never holds up a fast one. Meanwhile the other workers' updates landed, so when the
server applies a gradient computed on version v at version V, its **staleness** is V - v. With
``cfg.staleness_lr`` the server divides the learning rate by the staleness (Zhang et al. 2016,
"Staleness-aware Async-SGD", arXiv:1511.05950), so stale gradients move the model less.

The server's logic is a plain class (``ParameterServer``: pull, push, its staleness log) that a
test drives on a scripted schedule without processes; ``serve`` and ``work`` wrap it in messages.
``torch.distributed.rpc`` would do the same in fewer lines, but it is in maintenance mode.

Protocol (one float32 message each way; never a hang):
  server -> every worker: parameters + version (the first pull);
  worker -> server: [PUSH, version, loss, samples] + gradient; server -> worker: parameters +
  version;  ... ; once the server has applied workers x steps updates (plus warm-up) it
  answers a push with version -1 instead (not applied), and the worker stops;
  worker -> server: [DONE, ...] after its last step (also when it failed).
The server stops when every worker said DONE. Every receive is bounded by the process group's
timeout (``cfg.timeout_s``), and the launcher stops every rank on any failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ..config import RunConfig
from ..dist import RankContext, broadcast_parameters
from ..factories import Factories
from ..rank.balancer import straggler
from ..rank.loop import build_model, data_iter, final_state, train_loop
from ..rank.watch import Watch

PUSH, DONE = 1.0, 2.0
HEADER = 4  # kind, version, loss, samples


@dataclass
class ParameterServer:
    """The server's state and rules, without any communication.

    ``params``: a flat parameter tensor (the server's own copy); ``optimizer``: over
    ``[self.param]`` (made by ``make_optimizer``); every accepted push is one optimizer step."""

    params: torch.Tensor
    make_optimizer: object  # callable: [param] -> torch.optim.Optimizer
    staleness_lr: bool = False
    version: int = 0
    log: list[dict] = field(default_factory=list)  # one row per applied update

    def __post_init__(self):
        self.param = torch.nn.Parameter(self.params.detach().clone())
        self.optimizer = self.make_optimizer([self.param])
        self.base_lr = [g["lr"] for g in self.optimizer.param_groups]

    def pull(self) -> tuple[torch.Tensor, int]:
        """The current parameters and their version."""
        return self.param.detach(), self.version

    def push(self, worker: int, grad: torch.Tensor, version: int, **info) -> int:
        """Apply ``worker``'s gradient, computed on parameters of ``version``; return its
        staleness (how many updates landed since that version)."""
        staleness = self.version - int(version)
        if staleness < 0:
            raise ValueError(
                f"worker {worker} pushed a gradient of version {version}, newer than "
                f"the server's {self.version}: a message was lost or reordered"
            )
        scale = 1.0 / max(1, staleness) if self.staleness_lr else 1.0
        for group, lr in zip(self.optimizer.param_groups, self.base_lr):
            group["lr"] = lr * scale
        self.param.grad = grad.reshape(self.param.shape).to(self.param.dtype)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        self.log.append(
            {
                "update": self.version,
                "worker": worker,
                "grad_version": int(version),
                "staleness": staleness,
                "lr_scale": scale,
                **info,
            }
        )
        return staleness


def load_flat(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """The model's parameters set to a copy of ``flat`` (a received buffer is reused)."""
    vector_to_parameters(flat.detach().clone(), model.parameters())


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    model = build_model(cfg, ctx, fns)
    broadcast_parameters(model)
    if ctx.rank == 0:
        return serve(cfg, ctx, fns, model)
    return work(cfg, ctx, fns, model)


def serve(cfg: RunConfig, ctx: RankContext, fns: Factories, model: torch.nn.Module) -> dict:
    """Rank 0: answer pushes in arrival order until every worker is done; one record per update:
    its wait for a push, the update, the reply (the watch times and records them)."""
    workers = ctx.world_size - 1
    server = ParameterServer(
        parameters_to_vector(model.parameters()),
        lambda ps: fns.optimizer(cfg, ps),
        staleness_lr=cfg.staleness_lr,
    )
    n = server.param.numel()
    reply = torch.empty(n + 1)

    def answer(dst: int) -> None:
        params, version = server.pull()
        reply[:n] = params
        reply[n] = version
        dist.send(reply, dst=dst)

    for w in range(1, workers + 1):  # the first pull
        answer(w)
    inbox = torch.empty(n + HEADER)
    # the run ends after workers x steps applied updates (plus warm-up), whoever made them
    budget = workers * (cfg.warmup + cfg.steps)
    stop = torch.full((n + 1,), -1.0)
    watch = Watch(cfg, ctx, spans=False, warmup=workers * cfg.warmup, role="server")
    watch.begin(budget)
    watch.step_start(server.version)  # a step: from one applied update to the next
    done = 0
    while done < workers:
        with watch.phase("wait"):
            src = dist.recv(inbox)  # from any worker; bounded by the group's timeout
        kind, version, loss, samples = inbox[:HEADER].tolist()
        if kind == DONE:
            done += 1
            continue
        if server.version >= budget:  # the run has its updates: this one is not applied
            dist.send(stop, dst=src)
            continue
        with watch.phase("optimizer"):
            server.push(src, inbox[HEADER:], int(version), loss=loss, samples=samples)
        with watch.phase("comm"):
            answer(src)
        update = server.log[-1]
        watch.step_end(  # the push received, the reply sent (and stops since the last one)
            [(loss, int(samples))],
            worker=src,
            staleness=update["staleness"],
            lr_scale=update["lr_scale"],
            grad_version=update["grad_version"],
        )
        watch.step_start(server.version)
    load_flat(model, server.param.detach())
    return {**watch.result(final_state(cfg, model)), "updates": server.version}


def work(cfg: RunConfig, ctx: RankContext, fns: Factories, model: torch.nn.Module) -> dict:
    """Ranks 1..N-1: train on their shard; after each backward, push the gradient and pull the
    parameters (the shared loop's ``sync_grads``), so the local optimizer has nothing to do."""
    workers = ctx.world_size - 1
    data = data_iter(cfg, fns, rank=ctx.rank - 1, world_size=workers)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    reply, outbox = torch.empty(n + 1), torch.zeros(n + HEADER)
    dist.recv(reply, src=0)
    load_flat(model, reply[:n])
    version = [int(reply[n])]
    last_loss = [float("nan"), 0]

    def exchange() -> None:
        outbox[0], outbox[1] = PUSH, version[0]
        outbox[2], outbox[3] = last_loss
        outbox[HEADER:] = parameters_to_vector(
            p.grad if p.grad is not None else torch.zeros_like(p) for p in params
        )
        dist.send(outbox, dst=0)
        for p in params:  # the server applied it: no local optimizer step
            p.grad = None
        dist.recv(reply, src=0)
        if reply[n] < 0:  # the server has its updates: stop after this step
            version[0] = -1
            return
        load_flat(model, reply[:n])
        version[0] = int(reply[n])

    loss_fn = fns.loss(cfg)

    class LossTap(torch.nn.Module):  # the loss of the batch being pushed rides along
        def forward(self, out, y):
            loss = loss_fn(out, y)
            last_loss[0], last_loss[1] = float(loss.detach()), len(y)
            return loss

    try:
        out = train_loop(
            cfg,
            ctx,
            model,
            data,
            fns=fns,
            loss_fn=LossTap(),
            sync_grads=exchange,
            until=lambda: version[0] < 0,
            steps=workers * (cfg.warmup + cfg.steps) - cfg.warmup,
            # the server's records carry the loss per update; a worker's is its own
            watch=Watch(cfg, ctx, straggler(cfg, ctx), role="worker", loss_as="worker_loss"),
        )
    finally:
        outbox.zero_()
        outbox[0] = DONE
        dist.send(outbox, dst=0)
    return out
