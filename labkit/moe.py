"""A mixture-of-experts feed-forward block: a router picks k of E expert FFNs for every token.

Shazeer et al. 2017 (arXiv:1701.06538) put a learned router in front of many feed-forward
"experts" and ran only the k best for each token: parameters grow with E, compute with k. Three
rules come from the papers that trained it at scale, and labkit's block follows them:

* **top-k gating.** The router is one Linear, ``logits = W x + b``; ``p = softmax(logits)`` over
  all E experts; each token goes to its k largest. Its weights: for k > 1 the chosen k
  probabilities renormalised to sum to 1 (GShard's top-2, Lepikhin et al. 2020,
  arXiv:2006.16668, and Mixtral: the softmax of the chosen k logits); for k = 1 the probability
  itself (Switch, Fedus et al. 2021, arXiv:2101.03961: a weight of 1 would give the router no
  gradient from the loss).
* **capacity, counted per group.** Tokens are split into groups (GShard: one per device) and
  each expert takes at most ``capacity = ceil(capacity_factor x tokens x k / E)`` of a group's
  tokens, in a fixed order: every token's first choice before any second choice, and within a
  choice, token order. An assignment over capacity is *dropped*: its expert output is zero and
  the residual connection around the block carries the token on unchanged.
* **load balancing.** Switch's auxiliary loss ``E x sum_i f_i P_i`` (f_i: the fraction of the
  group's assignments routed to expert i, P_i: its mean router probability) is 1 when the load
  is even and grows as it concentrates; ``aux_loss`` is its coefficient (Switch used 0.01).

Groups are what make expert parallelism checkable: a rank's local tokens are its groups, so
single-device training that splits its batch into the same groups (``groups_of``: sample j of
a batch in group ``j % groups``, the samples a ``DistributedSampler`` deals to rank ``j % N``)
drops exactly the same tokens. ``router_skew`` adds a constant to expert 0's logit, a lever
that makes one expert popular and shows what capacity and the auxiliary loss do about it.

Where the experts run is the block's ``exchange``: None runs every expert here (the dense
reference); ``labkit.strategies.ep`` plugs in the all-to-all that runs each on its owner rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# what an exchange does with the routed rows: (experts here, rows sorted by expert, rows per
# expert (E,)) -> each row's expert output, in the same order
Exchange = Callable[[nn.ModuleDict, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class MoESpec:
    """The knobs of one MoE block (``RunConfig``'s ``experts``, ``top_k``, ...); ``groups``:
    token groups in one forward's batch, the capacity counted in each."""

    experts: int
    top_k: int = 1
    capacity_factor: float = 1.25
    aux_loss: float = 0.01
    router_skew: float = 0.0
    groups: int = 1

    def __post_init__(self):
        if self.experts < 1 or not 1 <= self.top_k <= self.experts:
            raise ValueError(
                f"a mixture of {self.experts} experts routes each token to top_k of them: "
                f"set experts >= 1 and 1 <= top_k <= experts (got top_k={self.top_k})"
            )
        if not self.capacity_factor > 0 or self.aux_loss < 0 or self.groups < 1:
            raise ValueError(
                f"capacity_factor must be positive, aux_loss >= 0 and groups >= 1 (got "
                f"{self.capacity_factor}, {self.aux_loss}, {self.groups})"
            )


def capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """The most assignments one expert takes from a group of ``tokens`` tokens."""
    return math.ceil(capacity_factor * tokens * top_k / experts)


@dataclass
class Routing:
    """Where a batch of grouped tokens goes. Kept assignments, in (group, choice, token) order:
    ``expert``, ``token`` (row of the grouped tokens) and ``gate`` (its weight). Per expert,
    over every group: ``routed`` (assignments it was chosen for) and ``dropped`` (of those, over
    its capacity). ``aux``: Switch's balancing loss, the mean over groups; ``chosen``: every
    token's k experts, best first (groups, tokens, k)."""

    expert: torch.Tensor
    token: torch.Tensor
    gate: torch.Tensor
    routed: torch.Tensor
    dropped: torch.Tensor
    capacity: int
    aux: torch.Tensor
    chosen: torch.Tensor


def route(logits: torch.Tensor, top_k: int, capacity_factor: float) -> Routing:
    """Top-k gating with a capacity per group: ``logits`` (groups, tokens, E)."""
    m, t, e = logits.shape
    probs = logits.softmax(-1, dtype=torch.promote_types(logits.dtype, torch.float32))  # fp32+
    top_p, top_e = probs.topk(top_k, dim=-1)  # (m, t, k)
    gates = top_p / top_p.sum(-1, keepdim=True) if top_k > 1 else top_p
    cap = capacity(t, e, top_k, capacity_factor)
    # each assignment's place in its expert's queue: every token's first choice, then every
    # second choice (GShard), token order within a choice
    choice = top_e.transpose(1, 2).reshape(m, top_k * t)  # (m, k t), choice-major
    onehot = F.one_hot(choice, e)  # (m, k t, E)
    place = (onehot.cumsum(1) - 1).gather(2, choice[..., None]).squeeze(-1)
    keep = place < cap
    token = (torch.arange(m)[:, None] * t + torch.arange(t).repeat(top_k)).to(choice.device)
    token = token.expand(m, top_k * t)
    gate = gates.transpose(1, 2).reshape(m, top_k * t)
    f = onehot.float().mean(1)  # (m, E): the share of the group's assignments per expert
    aux = (e * (f * probs.mean(1)).sum(-1)).mean()
    return Routing(
        expert=choice[keep],
        token=token[keep],
        gate=gate[keep],
        routed=torch.bincount(choice.flatten(), minlength=e),
        dropped=torch.bincount(choice[~keep], minlength=e),
        capacity=cap,
        aux=aux,
        chosen=top_e,
    )


def groups_of(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(batch, seq, h) -> (groups, batch/groups x seq, h): sample j in group ``j % groups``,
    each group's tokens in (sample, position) order."""
    b, s, h = x.shape
    if b % groups:
        raise ValueError(
            f"a batch of {b} samples does not split into {groups} token groups: pick a batch "
            f"per rank that is a multiple of the groups per rank"
        )
    return x.reshape(b // groups, groups, s, h).transpose(0, 1).reshape(groups, -1, h)


def ungroup(y: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """``groups_of``'s inverse."""
    m, _, h = y.shape
    return y.reshape(m, batch // m, seq, h).transpose(0, 1).reshape(batch, seq, h)


def run_experts(experts: nn.ModuleDict, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Every expert here, on its run of ``rows`` (sorted by expert; ``counts`` per expert, in
    the order of ``experts``' keys). Every expert runs, even on no rows, so its gradient is
    zero rather than absent (an optimizer treats the two differently)."""
    chunks = rows.split(counts.tolist())
    return torch.cat([expert(chunk) for expert, chunk in zip(experts.values(), chunks)])


class AddAuxLoss(torch.autograd.Function):
    """``y`` unchanged forward; backward, the auxiliary loss gets the gradient ``coef``: what it
    would get were ``coef x aux`` added to the loss (Megatron-LM's ``MoEAuxLossAutoScaler``), so
    any loss function trains the router's balance without knowing about it."""

    @staticmethod
    def forward(ctx, y, aux, coef):
        ctx.coef = coef
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.coef, device=grad.device), None


class MoE(nn.Module):
    """Router, E experts (each ``make_expert()``), top-k gating with a capacity per group:
    route, permute by expert, run the experts (``exchange``), un-permute, weight, add.

    ``experts`` is a ModuleDict keyed by expert index, so an expert's parameters carry the same
    name wherever it lives (``experts.3.fc1.weight``); ``tally`` adds up, since it was last
    emptied, each expert's routed and dropped assignments and the auxiliary loss per forward."""

    def __init__(self, hidden: int, spec: MoESpec, make_expert: Callable[[], nn.Module]):
        super().__init__()
        self.spec = spec
        self.router = nn.Linear(hidden, spec.experts)
        self.experts = nn.ModuleDict({str(i): make_expert() for i in range(spec.experts)})
        self.exchange: Exchange | None = None  # None: every expert here
        self.last: Routing | None = None
        self.empty_tally()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        spec = self.spec
        grouped = groups_of(x, spec.groups)  # (groups, tokens, h)
        logits = self.router(grouped)
        if spec.router_skew:  # a thumb on the scale: expert 0's logit raised
            skew = torch.zeros(spec.experts, dtype=logits.dtype, device=logits.device)
            skew[0] = spec.router_skew
            logits = logits + skew
        r = route(logits, spec.top_k, spec.capacity_factor)
        tokens = grouped.reshape(-1, h)
        order = torch.argsort(r.expert, stable=True)  # permute by expert (by owner rank too)
        rows = tokens[r.token[order]]
        counts = torch.bincount(r.expert, minlength=spec.experts)
        out = (self.exchange or run_experts)(self.experts, rows, counts)
        weighted = r.gate[order, None].to(out.dtype) * out
        y = out.new_zeros(tokens.shape).index_add(0, r.token[order], weighted)  # un-permute, add
        if spec.aux_loss and torch.is_grad_enabled():
            y = AddAuxLoss.apply(y, r.aux, spec.aux_loss)
        self.last = dataclasses.replace(r, gate=r.gate.detach(), aux=r.aux.detach())
        with torch.no_grad():
            self.routed += r.routed.cpu()
            self.dropped += r.dropped.cpu()
            self.aux_sum += float(r.aux)
            self.forwards += 1
        return ungroup(y.view(spec.groups, -1, h), b, s)

    def empty_tally(self) -> dict:
        """What the tally held (per expert: ``routed``, ``dropped``; ``aux``: the mean
        auxiliary loss per forward, NaN with none), then zero it."""
        held = {}
        if hasattr(self, "routed"):
            held = {
                "routed": self.routed.tolist(),
                "dropped": self.dropped.tolist(),
                "aux": self.aux_sum / self.forwards if self.forwards else math.nan,
            }
        self.routed = torch.zeros(self.spec.experts, dtype=torch.long)
        self.dropped = torch.zeros(self.spec.experts, dtype=torch.long)
        self.aux_sum, self.forwards = 0.0, 0
        return held

    def extra_repr(self) -> str:
        s = self.spec
        return (
            f"experts={s.experts}, top_k={s.top_k}, capacity_factor={s.capacity_factor}, "
            f"groups={s.groups}, aux_loss={s.aux_loss}, router_skew={s.router_skew}"
        )


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every MoE block of ``model``, in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]
