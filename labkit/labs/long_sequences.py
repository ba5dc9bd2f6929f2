"""Long sequences (notebook 14): context parallelism's runs, tables and predictions.

What the lesson draws comes from the code that runs it (``labkit.strategies.cp``):

* ``placement``: which positions each rank holds (contiguous or zig-zag);
* ``ring_steps``: the ring's schedule, one row per rank, step and tile (``cp.schedule``): which
  key/value block each rank holds at step s and which query-key tiles it computes, skips or
  masks;
* ``work``: each rank's attention work counted from that schedule (tiles by kind, FLOPs);
* ``on_threads``: the ring (or Ulysses) run on gloo ranks that are threads of this process,
  against dense attention on one process, with the work each rank counted while it ran.

What is measured, on rank processes, beside what predicts it:

* ``measure``: each rank's attention compute time and wall time, the tiles it computed and the
  bytes it sent forward and backward (counted on the process group by ``labkit.wire``);
* ``bytes_formula`` / ``bytes_table``: those bytes against the formulas (ring: K and V, (N-1)/N of
  the sequence's, per layer forward; the backward sends them again and dK, dV home; Ulysses:
  four all-to-alls each way of (N-1)/N of a rank's b x s/N x h);
* ``step_bytes``: a whole training step's bytes per rank (attention, the gradient sum, the
  head's broadcast), against a run's records;
* ``activations``: activation memory per rank (the memory meter) of single-device training and
  of context parallelism at several N, against single's divided by N.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import pandas as pd
import torch
import torch.distributed as dist

from .. import registry
from ..config import RunConfig
from ..dist import on_threads as _on_threads
from ..experiment import run
from ..launch import launch
from ..models import Head, make_model
from ..predict.collectives import coefficients
from ..strategies import cp
from ..strategies.cp_ulysses import ulysses_attention
from ..wire import traffic

METHODS = ("ring", "ulysses")
LAYOUTS = ("contiguous", "zigzag")
# the context-parallel strategies (labkit.registry): the ring, and the all-to-all over heads
SPLIT = registry.names("context_parallel")
RING = next(n for n in SPLIT if not registry.get(n).heads_split)
ULYSSES = next(n for n in SPLIT if registry.get(n).heads_split)


def method_of(strategy: str) -> str:
    """A context-parallel strategy's attention: "ulysses" (all-to-all) or "ring"."""
    return "ulysses" if registry.get(strategy).heads_split else "ring"


def _check(n: int, layout: str, method: str = "ring") -> None:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n (ranks) must be a whole number >= 1, got {n!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")


# ---- what each rank holds and computes, from the code's own schedule -----------------------------


def placement(n: int, seq_len: int, layout: str) -> pd.DataFrame:
    """One row per (rank, chunk): the chunk's index and its first and last position."""
    _check(n, layout)
    c = cp.chunk_len(n, seq_len, layout)
    return pd.DataFrame(
        [
            {"rank": r, "chunk": i, "first": i * c, "last": (i + 1) * c - 1}
            for r in range(n)
            for i in cp.chunk_ids(r, n, layout)
        ]
    )


def ring_steps(n: int, layout: str, causal: bool = True) -> pd.DataFrame:
    """``cp.schedule`` for every rank, one row per (rank, step, tile): the rank whose keys and
    values it holds (``kv_from``), the query and key chunks and the tile's kind (full,
    diagonal, skipped)."""
    _check(n, layout)
    return pd.DataFrame(
        [
            {
                "rank": r,
                "step": s.step,
                "kv_from": s.kv_from,
                "q_chunk": t.q_chunk,
                "k_chunk": t.k_chunk,
                "kind": t.kind,
            }
            for r in range(n)
            for s in cp.schedule(r, n, layout, causal)
            for t in s.tiles
        ]
    )


def work(
    n: int,
    layout: str,
    causal: bool = True,
    *,
    seq_len: int | None = None,
    batch: int = 1,
    heads: int = 1,
    head_dim: int = 1,
) -> pd.DataFrame:
    """Each rank's attention work counted from the schedule: tiles by kind, ``computed`` (full +
    diagonal: a diagonal tile is computed whole, then masked), and the FLOPs: 4 b H d c^2
    forward and 10 b H d c^2 backward per computed c x c tile (two matrix products forward;
    backward recomputes the scores and makes four more). ``seq_len`` None: the work in units
    of one (s/2N)^2 tile's forward, the same unit for both layouts (a contiguous chunk is two
    zig-zag chunks long: its tile is four units). ``imbalance``: the rank's work over the
    mean's."""
    _check(n, layout)
    steps = ring_steps(n, layout, causal)
    counts = steps.groupby(["rank", "kind"]).size().unstack(fill_value=0)
    df = pd.DataFrame({"rank": range(n)})
    for kind in (cp.FULL, cp.DIAGONAL, cp.SKIPPED):
        df[kind] = [int(counts.loc[r, kind]) if kind in counts else 0 for r in range(n)]
    df["computed"] = df[cp.FULL] + df[cp.DIAGONAL]
    if seq_len is None:  # in (s/2N)^2 tiles' forward work
        per = (4.0 if layout == "contiguous" else 1.0) * df["computed"]
        df["flops_forward"], df["flops_backward"] = per, 2.5 * per
    else:
        c = cp.chunk_len(n, seq_len, layout)
        tile = float(batch * heads * head_dim * c * c)
        df["flops_forward"] = 4 * tile * df["computed"]
        df["flops_backward"] = 10 * tile * df["computed"]
    df["imbalance"] = df["flops_forward"] / df["flops_forward"].mean()
    df.attrs["units"] = "(s/2N)² tiles" if seq_len is None else "FLOPs"
    return df


# ---- run on thread ranks: the code against dense attention ---------------------------------------


def _inputs(batch: int, heads: int, seq_len: int, head_dim: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (
        torch.randn(batch, heads, seq_len, head_dim, generator=g, dtype=dtype) for _ in range(4)
    )
    return q, k, v, dout


def on_threads(
    n: int,
    layout: str = "zigzag",
    method: str = "ring",
    *,
    causal: bool = True,
    batch: int = 2,
    heads: int = 4,
    seq_len: int = 32,
    head_dim: int = 8,
    merge=None,
) -> pd.DataFrame:
    """Ring (or Ulysses) attention forward and backward on ``n`` gloo ranks that are threads
    of this process, each rank's queries against the whole sequence, beside dense attention
    computed in one piece here (float64): per rank, the largest difference of the output and
    of dQ, dK, dV, and the tiles it counted while running. ``merge``: the online-softmax merge
    the ring uses (``cp.combine``; a learner's own in the exercise)."""
    _check(n, layout, method)
    cp.chunk_len(n, seq_len, layout)  # a sequence that does not cut evenly: said here
    q, k, v, dout = _inputs(batch, heads, seq_len, head_dim)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    dense = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    dense.backward(dout)
    want = [dense.detach()] + [t.grad for t in leaves]

    def rank(group):
        pos = cp.positions(group.rank(), n, seq_len, layout)
        mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
        counted = cp.AttentionWork()
        if method == "ring":
            out = cp.ring_attention(*mine, group, layout, causal, counted, merge or cp.combine)
        else:
            out = ulysses_attention(*mine, group, layout, causal)
        out.backward(dout[:, :, pos])
        got = [out.detach()] + [t.grad for t in mine]
        diffs = [float((g - w[:, :, pos]).abs().max()) for g, w in zip(got, want)]
        return {
            "rank": group.rank(),
            **dict(zip(("out", "dq", "dk", "dv"), diffs)),
            **counted.tiles,
        }

    return pd.DataFrame(_on_threads(rank, n, timeout_s=60.0))


# ---- measured on rank processes ------------------------------------------------------------------


def _measure_rank(ctx, layout, method, shape, causal, warmup, repeats) -> list[dict]:
    batch, heads, seq_len, head_dim = shape
    group = dist.group.WORLD
    n, r = group.size(), group.rank()
    q, k, v, dout = _inputs(batch, heads, seq_len, head_dim, torch.float32)
    pos = cp.positions(r, n, seq_len, layout)
    tally, rows = traffic(), []
    for i in range(warmup + repeats):
        mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
        counted = cp.AttentionWork()
        dist.barrier()
        tally.take()
        t0 = time.perf_counter()
        if method == "ring":
            out = cp.ring_attention(*mine, group, layout, causal, counted)
        else:
            out = ulysses_attention(*mine, group, layout, causal)
        t1 = time.perf_counter()
        forward = tally.take()
        out.backward(dout[:, :, pos])
        t2 = time.perf_counter()
        backward = tally.take()
        ctx.report(step=i + 1, total=warmup + repeats)
        if i >= warmup:
            rows.append(
                {
                    "rank": r,
                    "repeat": i - warmup,
                    "forward_s": t1 - t0,
                    "backward_s": t2 - t1,
                    "compute_s": counted.compute_s if method == "ring" else float("nan"),
                    **counted.tiles,
                    "flops_forward": counted.flops_forward,
                    "flops_backward": counted.flops_backward,
                    "bytes_forward": forward["comm_bytes"],
                    "bytes_backward": backward["comm_bytes"],
                    "calls_forward": forward["comm_calls"],
                    "calls_backward": backward["comm_calls"],
                }
            )
    return rows


def measure(
    n: int,
    layout: str = "zigzag",
    method: str = "ring",
    *,
    causal: bool = True,
    batch: int = 1,
    heads: int = 8,
    seq_len: int = 2048,
    head_dim: int = 32,
    warmup: int = 1,
    repeats: int = 3,
    timeout_s: float = 120.0,
    on_progress=None,
    cancel=None,
) -> pd.DataFrame:
    """One attention layer's forward and backward on ``n`` rank processes, ``repeats`` times
    after ``warmup``: per rank and repeat, wall seconds forward and backward, the ring's compute
    seconds (tiles only, waits excluded; NaN for Ulysses), the tiles and FLOPs it computed, and
    the bytes and operations it put on the process group each way (``labkit.wire``).
    ``on_progress(rank, {"step", "total"})`` after each repeat; ``cancel``: an Event that stops
    every rank (a panel's Stop)."""
    _check(n, layout, method)
    cp.chunk_len(n, seq_len, layout)
    if method == "ulysses" and heads % n:
        raise ValueError(f"Ulysses gives each rank whole heads: {heads} heads over {n} ranks")
    shape = (batch, heads, seq_len, head_dim)
    per_rank = launch(
        _measure_rank,
        n,
        args=(layout, method, shape, causal, warmup, repeats),
        device="cpu",
        timeout_s=timeout_s,
        on_progress=on_progress,
        cancel=cancel,
    )
    df = pd.DataFrame([row for rows in per_rank for row in rows])
    df["layout"], df["method"], df["n"] = layout, method, n
    df.attrs["shape"] = dict(zip(("batch", "heads", "seq_len", "head_dim"), shape))
    return df


def per_rank(measured: pd.DataFrame) -> pd.DataFrame:
    """``measure``'s repeats reduced to one row per rank (medians)."""
    cols = ["forward_s", "backward_s", "compute_s", cp.FULL, cp.DIAGONAL, cp.SKIPPED]
    cols += ["flops_forward", "bytes_forward", "bytes_backward"]
    return measured.groupby("rank")[cols].median().reset_index()


# ---- bytes: the formulas, and the measurement beside them ---------------------------------------


def bytes_formula(
    method: str, n: int, *, batch: int, seq_len: int, hidden: int, element: int = 4
) -> dict:
    """Bytes one rank sends for one attention layer (hidden = heads x head_dim, ``element``
    bytes per number):

    * ring, forward: K and V of each of the other N - 1 ranks' slices pass through it: 2 (N-1)
      messages of b x s/N x h = 2 (N-1)/N b s h elements;
    * ring, backward (``cp.RingAttention.backward``): K and V again (N - 1 hops), and each
      block's dK, dV accumulator on its way home (N - 1 hops): 4 (N-1)/N b s h;
    * Ulysses, each way: four all-to-alls (forward q, k, v and the output; backward the
      output's gradient and dQ, dK, dV), each keeping 1/N of a b x s/N x h tensor and sending
      the rest: 4 (N-1)/N b (s/N) h."""
    _check(n, "contiguous", method)
    share = coefficients("reduce_scatter", n)[1]  # (N-1)/N
    bsh = batch * seq_len * hidden * element
    if method == "ring":
        return {"forward": 2 * share * bsh, "backward": 4 * share * bsh}
    return {"forward": 4 * share * bsh / n, "backward": 4 * share * bsh / n}


def bytes_table(measured: pd.DataFrame) -> pd.DataFrame:
    """``measure``'s bytes per rank beside ``bytes_formula``: one row per (method, n, rank,
    direction), ``ratio`` measured / formula."""
    rows = []
    for (method, n), df in measured.groupby(["method", "n"]):
        shape = df.attrs.get("shape") or measured.attrs["shape"]
        want = bytes_formula(
            method,
            int(n),
            batch=shape["batch"],
            seq_len=shape["seq_len"],
            hidden=shape["heads"] * shape["head_dim"],
        )
        for r, ranks in df.groupby("rank"):
            for way in ("forward", "backward"):
                got = float(ranks[f"bytes_{way}"].median())
                rows.append(
                    {
                        "method": method,
                        "n": int(n),
                        "rank": int(r),
                        "direction": way,
                        "measured_bytes": got,
                        "formula_bytes": want[way],
                        "ratio": got / want[way] if want[way] else float("nan"),
                    }
                )
    return pd.DataFrame(rows)


def step_bytes(cfg: RunConfig) -> pd.DataFrame:
    """What one training step of ``cfg`` (``cp`` or ``cp_ulysses``) sends per rank, by term:
    attention (``bytes_formula`` per layer, times the layers), the gradient sum over the group
    (an all-reduce of every parameter but the head's, 2(N-1)/N of them) and the head's input
    broadcast from the rank holding the last position (b x h, forwarded by every rank of the
    chain but the last). To set beside a run's ``comm_bytes`` records."""
    from ..strategies.cp import last_position_owner

    n, method = cfg.world_size, method_of(cfg.strategy)
    layer = bytes_formula(method, n, batch=cfg.global_batch, seq_len=cfg.seq_len, hidden=cfg.width)
    model = make_model(cfg)
    head = sum(p.numel() for m in model.modules() if isinstance(m, Head) for p in m.parameters())
    params = sum(p.numel() for p in model.parameters()) - head
    grads = coefficients("all_reduce", n)[1] * params * 4
    owner = last_position_owner(n, cfg.seq_len, cfg.cp_layout)
    rows = []
    for r in range(n):
        attention = cfg.depth * (layer["forward"] + layer["backward"])
        broadcast = 0.0 if n == 1 or r == (owner - 1) % n else cfg.global_batch * cfg.width * 4
        rows.append(
            {
                "rank": r,
                "attention": attention,
                "gradient_sum": grads,
                "head_broadcast": broadcast,
                "predicted": attention + grads + broadcast,
            }
        )
    return pd.DataFrame(rows)


# ---- activation memory per rank -----------------------------------------------------------------


def activations(
    base: RunConfig, ns: Sequence[int] = (2, 4), strategy: str = RING, steps: int = 2
) -> pd.DataFrame:
    """Activation bytes per rank (the memory meter's ``mem_activations_bytes``) of single-device
    training, then of ``strategy`` at each N in ``ns``, beside single's divided by N: one row
    per (N, rank), ``error`` = measured / predicted - 1. Differences that remain are per rank
    and known: the embedding's input slice, a copy here (single reads the batch itself), and
    the head's input, one position on every rank (single keeps the last layer's whole output
    alive through its view of position s - 1)."""
    cfg = base.replace(steps=steps, warmup=1)
    reference = cfg.replace(strategy=registry.REFERENCE, world_size=1, cp=None, cp_layout="zigzag")
    single = run(reference).records
    whole = float(single["mem_activations_bytes"].median())
    rows = [{"n": 1, "rank": 0, "measured": whole, "predicted": whole}]
    for n in ns:
        rec = run(cfg.replace(strategy=strategy, world_size=n)).records
        for r, df in rec.groupby("rank"):
            rows.append(
                {
                    "n": n,
                    "rank": int(r),
                    "measured": float(df["mem_activations_bytes"].median()),
                    "predicted": whole / n,
                }
            )
    out = pd.DataFrame(rows)
    out["error"] = out["measured"] / out["predicted"] - 1
    return out


# ---- the calculator at scale, and a published long-context layout -------------------------------

LLAMA3_SOURCE = (
    "Dubey et al. 2024, 'The Llama 3 Herd of Models' (arXiv:2407.21783): Table 3 (405B: 126 "
    "layers, model dimension 16,384, 128 heads, 8 key/value heads, vocabulary 128,256) and "
    "Table 4 (the 128K-context stage: 16,384 H100 80GB GPUs, TP 8, CP 16, PP 16, DP 8, sequence "
    "131,072, 16M tokens per batch, 380 TFLOP/s per GPU; the 8K stage on as many GPUs: CP 1, "
    "DP 128). 128 layers here (16 stages of 8; the paper's 126 are cut unevenly), a 12h^2 "
    "layer (its SwiGLU and grouped-query attention hold 11.9h^2) and no position table (RoPE)"
)
LLAMA3_405B = dict(layers=128, hidden=16384, heads=128, kv_heads=8, vocab=128256)
LLAMA3_128K = dict(gpus=16384, tp=8, cp=16, pp=16, dp=8, seq=131072, global_batch=128)


def attention_growth(
    seqs: Sequence[int] = (2048, 8192, 32768, 131072), *, hidden: int = 4096, heads: int = 32
) -> pd.DataFrame:
    """Why the sequence is what grows: one layer's activations for one sequence (Korthikanti et
    al. 2022's s b h (34 + 5 a s / h), ``predict.memory.layer_activations``) split into the
    per-token part (34 s b h: linear in s) and the attention scores' (5 a s^2 b: quadratic),
    and the layer's forward FLOPs likewise (24 b s h^2 for the matrices, 4 b s^2 h for the
    scores and their product with the values, ``predict.layout.iteration_flops``)."""
    from ..predict.memory import layer_activations

    rows = []
    for s in seqs:
        shape = dict(seq=s, micro_batch=1, hidden=hidden, heads=heads)
        whole = layer_activations(**shape)
        per_token = layer_activations(**shape, recompute="selective")
        rows.append(
            {
                "seq": s,
                "per_token_GB": per_token / 1e9,
                "scores_GB": (whole - per_token) / 1e9,
                "scores_share": (whole - per_token) / whole,
                "attention_flops_share": 4
                * s
                * s
                * hidden
                / (24 * s * hidden**2 + 4 * s * s * hidden),
            }
        )
    return pd.DataFrame(rows)


def published_long_context(reserve: float = 0.1) -> pd.DataFrame:
    """Llama 3 405B's published 128K layout (``LLAMA3_128K``, ``LLAMA3_SOURCE``) and the same
    GPUs without context parallelism (cp 1, dp 128), by the calculator, per GPU of the first
    pipeline stage: model states (mixed-precision Adam, ZeRO-1 over the dp x cp GPUs that hold
    the same parameters) and activations, with flash attention (no s x s scores kept or
    rebuilt: Korthikanti's selective row for the layer backward rebuilds) under full
    recomputation (each layer keeps its 2 s b h / (t cp) input; 1F1B keeps pp micro-batches in
    flight on the first stage). ``fits``: within an H100's 80 GB less ``reserve``."""
    from ..predict.memory import layer_activations, model_states

    m, lay = LLAMA3_405B, LLAMA3_128K
    psi = m["layers"] * 12 * m["hidden"] ** 2 + 2 * m["vocab"] * m["hidden"]
    rows = []
    for cp_degree, dp in ((lay["cp"], lay["dp"]), (1, lay["dp"] * lay["cp"])):
        shape = dict(seq=lay["seq"], micro_batch=1, hidden=m["hidden"], heads=m["heads"])
        shape.update(tp=lay["tp"], sequence_parallel=True, cp=cp_degree)
        kept = layer_activations(**shape, recompute="full")
        rebuilt = layer_activations(**shape, recompute="selective")
        layers_here = m["layers"] // lay["pp"]
        acts = layers_here * lay["pp"] * kept + rebuilt
        states = model_states(psi, dp=dp * cp_degree, zero=1, tp=lay["tp"], pp=lay["pp"])
        total = sum(states.values()) + acts
        rows.append(
            {
                "layout": f"tp {lay['tp']} x cp {cp_degree} x pp {lay['pp']} x dp {dp}",
                "cp": cp_degree,
                "states_GB": sum(states.values()) / 1e9,
                "activations_GB": acts / 1e9,
                "total_GB": total / 1e9,
                "fits": total <= 80e9 * (1 - reserve),
                "published": cp_degree == lay["cp"],
            }
        )
    out = pd.DataFrame(rows)
    out.attrs["source"] = LLAMA3_SOURCE
    return out


# ---- torch's own context parallelism, tried on this machine's ranks ----------------------------


def _torch_cp_rank(ctx, seq_len: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    q, k, v, _ = _inputs(1, 2, seq_len, 8, torch.float32)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    buffers = [t.clone() for t in (q, k, v)]  # sharded along the sequence in place
    try:
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
            out = torch.nn.functional.scaled_dot_product_attention(*buffers, is_causal=True)
        (whole,) = context_parallel_unshard(mesh, [out], [2])
        return {"ran": True, "diff": float((whole - dense).abs().max()), "error": ""}
    except Exception as exc:  # what torch says, kept word for word
        return {"ran": False, "diff": float("nan"), "error": f"{type(exc).__name__}: {exc}"}


def torch_context_parallel(n: int = 2, seq_len: int = 16) -> pd.DataFrame:
    """torch's own ``torch.distributed.tensor.experimental.context_parallel`` (its ring
    attention over a ``DeviceMesh``) on ``n`` rank processes of this machine's device: per
    rank, whether causal attention ran and its difference from dense attention, or the error
    torch raised. On CPU with torch 2.14, ``scaled_dot_product_attention`` dispatches to
    ``aten._scaled_dot_product_flash_attention_for_cpu``, for which context parallelism has no
    ring handler (it has them for the CUDA flash, efficient and cuDNN kernels)."""
    return pd.DataFrame(launch(_torch_cp_rank, n, args=(seq_len,), device="auto", timeout_s=120))
