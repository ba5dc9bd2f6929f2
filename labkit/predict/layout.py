"""The layout advisor: how to split a large transformer over a cluster, before anything runs.

A GPT-style model on ``gpus`` GPUs can be laid out many ways: tensor parallelism ``tp`` (each
layer's matrices split over GPUs, Megatron-LM), pipeline parallelism ``pp`` (consecutive layers
on consecutive GPUs), data parallelism ``dp`` for the rest (``tp * pp * dp = gpus``), a ZeRO
stage, a micro-batch size and a recomputation policy. ``plan`` enumerates them, asks the memory
calculator (``labkit.predict.memory.transformer_layout``) whether each fits on one GPU and a
cost model how long a training step takes, and ranks them: fastest first among those that fit.

What the numbers are:

* **Published** (labelled so in ``DEVICES`` and ``LINKS``, each with its source): peak dense
  16-bit FLOP/s, memory, NVLink and InfiniBand bandwidths per direction. Latencies are typical
  values, **not published**.
* **Assumed**: ``mfu``, the fraction of peak the GPU reaches while it computes (the matrix
  multiplications of forward, backward and recomputation). Default 0.5, labkit's one figure for
  large dense training (``labkit.predict.whatif`` assumes the same for the H100). Communication
  and pipeline bubbles come on top, so the whole step reaches less than ``mfu`` of peak.
* **Assumed**: where ranks sit (Megatron-LM's order: tp ranks adjacent, then dp, then pp), that
  collectives follow the ring alpha-beta model (``labkit.predict.collectives``) and that the
  data-parallel communication is not overlapped with compute (``dp_overlap=0``: Megatron-LM as
  of SC'21 all-reduced its gradients after the backward pass).

The step of one layout (every term is a field of ``Layout``):

    step = compute + tp_comm + pp_bubble + pp_comm + (1 - dp_overlap) * dp_comm + cp_comm

``compute``: the FLOPs of one iteration as Narayanan et al. count them (SC'21, Appendix; see
``iteration_flops``) over ``gpus * peak * mfu``. ``tp_comm``: 4 all-reduces of the b*s*h
16-bit activations per layer and micro-batch (2 forward, 2 backward; 6 with full recomputation,
whose extra forward repeats its 2) on the node's NVLink. ``pp_bubble``: the 1F1B pipeline's
idle share (P-1)/(M+P-1) of each stage's time (``labkit.predict.schedule.theory_bubble``).
``pp_comm``: one activation hand-off forward and one gradient hand-off backward per pipeline
slot. ``dp_comm``: the gradients' reduction across data-parallel ranks (ZeRO's variants below).
``cp_comm``: context parallelism's ring (``ring_pass_s``), cp GPUs each holding s/cp of every
sequence (``cp_choices``; 1 by default): what of the keys' and values' passes round the ring
its attention blocks do not hide. With cp, activations and the tp and pp messages shrink by cp,
and the gradients are reduced over the dp * cp GPUs that hold the same parameters.

Each GPU's TFLOP/s is reported two ways: ``tflops_per_gpu`` counts the model's FLOPs as 6 * N
per token (N parameters; Kaplan et al. 2020): useful work only, whatever is recomputed;
``sc21_tflops_per_gpu`` counts what the GPU executes, SC'21's way (attention and logits included,
recomputation's extra forward too): the convention of the published table ``SC21``, so the one
to compare with it (``compare_sc21``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from . import memory
from .collectives import AlphaBeta, coefficients
from .schedule import theory_bubble
from .whatif import INTERCONNECTS

GB = 1e9

LINKS = {
    "NVLink 3 (A100)": AlphaBeta(
        3e-6,
        300 * GB,
        "published 600 GB/s bidirectional = 300 GB/s per direction per GPU (NVIDIA A100 "
        "datasheet); 3 us latency typical, not published",
    ),
    "NVLink 4 (H100)": INTERCONNECTS["NVLink 4 (H100)"],
    "200 Gb/s InfiniBand (HDR)": AlphaBeta(
        3e-6, 25 * GB, "published 200 Gb/s = 25 GB/s per port; 3 us latency typical"
    ),
    "400 Gb/s InfiniBand (NDR)": INTERCONNECTS["400 Gb/s InfiniBand (NDR)"],
}


@dataclass(frozen=True)
class GPU:
    """One accelerator and the node it comes in: peak dense 16-bit FLOP/s, memory, the NVLink
    between the GPUs of a node and the InfiniBand port each GPU has to other nodes (DGX nodes
    have one port per GPU)."""

    name: str
    peak_flops: float
    memory_bytes: float
    nvlink: str  # a key of LINKS
    network: str  # a key of LINKS: one port per GPU
    source: str


DEVICES = {
    "A100 80GB": GPU(
        "A100 80GB",
        312e12,
        80 * GB,
        "NVLink 3 (A100)",
        "200 Gb/s InfiniBand (HDR)",
        "published: A100 SXM 80GB datasheet, 312 TFLOP/s dense BF16/FP16 tensor core, 80 GB "
        "HBM2e, NVLink 3 600 GB/s; DGX A100: 8 GPUs and 8 HDR InfiniBand ports per node",
    ),
    "H100 SXM 80GB": GPU(
        "H100 SXM 80GB",
        989e12,
        80 * GB,
        "NVLink 4 (H100)",
        "400 Gb/s InfiniBand (NDR)",
        "published: H100 SXM datasheet, 989 TFLOP/s dense BF16 tensor core, 80 GB HBM3, "
        "NVLink 4 900 GB/s; DGX H100: 8 GPUs and 8 NDR InfiniBand ports per node",
    ),
}

MFU = 0.5  # assumed share of peak while computing; see the module docstring
RESERVE = 0.1  # share of device memory kept for the CUDA context, NCCL, fragmentation
MICROBATCHES = (1, 2, 4, 8)
FLOPS_CONVENTION = (
    "TFLOP/s per GPU = 6 x parameters x tokens / step (model FLOPs, Kaplan et al.); "
    "SC'21's convention (attention, logits and recomputation counted) in sc21_tflops_per_gpu"
)


@dataclass(frozen=True)
class Layout:
    """One way to lay the model out, its memory on the fullest GPU and its predicted step.

    ``microbatches`` is m, the micro-batches each pipeline runs per step (global batch / (dp *
    microbatch)); bytes are per GPU, on the first pipeline stage; ``device_memory_bytes`` is
    what the advisor lets a layout use (device memory less the reserve); seconds per step."""

    tp: int
    pp: int
    dp: int
    zero: int
    microbatch: int
    recompute: str
    microbatches: int
    mem_per_gpu_bytes: float
    device_memory_bytes: float
    fits: bool
    step_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    sc21_tflops_per_gpu: float
    compute_s: float
    tp_comm_s: float
    pp_bubble_s: float
    pp_comm_s: float
    dp_comm_s: float
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    cp: int = 1  # context-parallel degree: GPUs sharing each sequence
    cp_comm_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SC21Row:
    """One row of Megatron-LM's weak-scaling table: a GPT model, the layout its authors chose
    and the TFLOP/s per GPU they achieved (SC'21 convention, see ``iteration_flops``)."""

    name: str
    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    tflops_per_gpu: float
    seq: int = 2048
    vocab: int = 51200

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


SC21_SOURCE = (
    "Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
    "Megatron-LM', SC'21 (arXiv:2104.04473), Table 1: sequence 2048, vocabulary 51,200, "
    "A100 80GB in DGX A100 nodes (8 GPUs, 8 HDR InfiniBand ports each), mixed precision, "
    "full activation recomputation, TFLOP/s per GPU counted with the paper's Appendix formula"
)

# Checked against the paper: every row's tp * pp divides its GPUs (dp = 32 up to 76.1B, then
# 24, 15, 9, 6), heads divide hidden, pp divides layers, and the parameters() count of each
# shape rounds to the row's label (1.65e9 is the "1.7B").
SC21 = [
    SC21Row("1.7B", 1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    SC21Row("3.6B", 3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    SC21Row("7.5B", 7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    SC21Row("18.4B", 18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    SC21Row("39.1B", 39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    SC21Row("76.1B", 76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    SC21Row("145.6B", 145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    SC21Row("310.1B", 310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    SC21Row("529.6B", 529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    SC21Row("1008.0B", 1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def iteration_flops(
    *, layers: int, hidden: int, seq: int, vocab: int, batch: int, recompute: str = "full"
) -> float:
    """FLOPs of one training iteration on ``batch`` sequences, counted as Narayanan et al. do
    (SC'21, Appendix): a layer's forward is 24*B*s*h^2 (its matrix multiplications) + 4*B*s^2*h
    (attention scores and their product with the values), backward twice the forward, and the
    output layer's logits 2*B*s*h*V forward (x3 with backward). With full recomputation each
    layer runs its forward twice, which gives the paper's formula

        96 * B * s * l * h^2 * (1 + s/(6h) + V/(16*l*h));

    without recomputation 72 * B*s*l*h^2 * (1 + s/(6h) + V/(12*l*h)); selective recomputation
    (Korthikanti et al. 2022) reruns only the attention core, 4*B*s^2*h per layer."""
    memory._check_recompute(recompute)
    b, s, h = batch, seq, hidden
    matmul, attention = 24 * b * s * h * h, 4 * b * s * s * h
    per_layer = 3 * (matmul + attention)
    if recompute == "full":
        per_layer += matmul + attention
    elif recompute == "selective":
        per_layer += attention
    return layers * per_layer + 6 * b * s * h * vocab


def model_flops(*, layers: int, hidden: int, seq: int, vocab: int, batch: int) -> float:
    """6 * N * tokens: the FLOPs per iteration of Kaplan et al. (2020), N from
    ``memory.parameters``. What the model needs, not what the GPU executes: attention scores and
    recomputation are not counted."""
    n = memory.parameters(layers=layers, hidden=hidden, vocab=vocab, seq=seq)
    return 6 * n * batch * seq


def plan(
    *,
    layers: int,
    hidden: int,
    heads: int,
    seq: int,
    vocab: int,
    gpus: int,
    global_batch: int,
    gpus_per_node: int = 8,
    device: str = "A100 80GB",
    zero_stages: Sequence[int] = (0, 1, 2, 3),
    recompute: Sequence[str] = memory.RECOMPUTE,
    microbatches: Sequence[int] = MICROBATCHES,
    tp_choices: Sequence[int] | None = None,
    pp_choices: Sequence[int] | None = None,
    mfu: float = MFU,
    reserve: float = RESERVE,
    dp_overlap: float = 0.0,
    sequence_parallel: bool = False,
    optimizer: str = "adam",
    cp_choices: Sequence[int] = (1,),
    kv_heads: int | None = None,
) -> list[Layout]:
    """Every layout of the model on ``gpus`` GPUs, best first: the highest tokens/s among those
    that fit (ties: less memory first), then those that do not fit, smallest first.

    Enumerated: tp among the divisors of ``gpus_per_node`` that divide ``heads`` (tensor
    parallelism's all-reduces stay on NVLink, inside a node), pp among the divisors of
    ``layers``, dp = gpus / (tp * pp), micro-batch sizes whose dp * size divides
    ``global_batch``, ZeRO stages (ZeRO-2 and -3 only with pp = 1, as DeepSpeed and Megatron-LM
    allow; no ZeRO stage when dp = 1, where it shards nothing) and recomputation policies.
    ``tp_choices``/``pp_choices`` restrict tp and pp (None: all). A layout fits when its
    memory per GPU is at most the device's memory less ``reserve`` (a share kept for the CUDA
    context, NCCL buffers and fragmentation). ``cp_choices``: context-parallel degrees to try
    (each dividing the sequence into 2 cp chunks; dp = gpus / (tp * pp * cp)); ``kv_heads``:
    the key/value heads, fewer than ``heads`` under grouped-query attention (the ring's bytes).
    """
    gpu = _device(device)
    _check_plan(layers, hidden, heads, gpus, gpus_per_node, global_batch, mfu, reserve, dp_overlap)
    model = dict(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab)
    cluster = dict(
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        global_batch=global_batch,
        gpu=gpu,
        mfu=mfu,
        reserve=reserve,
        dp_overlap=dp_overlap,
        sequence_parallel=sequence_parallel,
        optimizer=optimizer,
        kv_heads=kv_heads,
    )
    choices = (tp_choices, pp_choices, cp_choices)
    out = [
        evaluate(**model, **cluster, **knobs)
        for knobs in _candidates(model, cluster, zero_stages, recompute, microbatches, *choices)
    ]
    if not out:
        raise ValueError(
            f"no layout splits a global batch of {global_batch} over {gpus} GPUs with micro-"
            f"batches of {', '.join(map(str, microbatches))}: choose a global batch that is a "
            f"multiple of the GPU count ({gpus}), or a GPU count whose divisors divide it"
        )
    return sorted(out, key=_rank)


def _candidates(
    model, cluster, zero_stages, recompute, microbatches, tp_choices, pp_choices, cp_choices=(1,)
):
    """The (tp, pp, cp, dp, zero, microbatch, recompute) a plan considers (see ``plan``)."""
    gpus, per_node, batch = cluster["gpus"], cluster["gpus_per_node"], cluster["global_batch"]
    tps = [t for t in _divisors(per_node) if model["heads"] % t == 0 and gpus % t == 0]
    pps = _divisors(model["layers"])
    for tp in (t for t in tps if tp_choices is None or t in tp_choices):
        for pp, cp in ((p, c) for p in pps if pp_choices is None or p in pp_choices
                       for c in cp_choices if model["seq"] % (2 * c) == 0):  # fmt: skip
            if gpus % (tp * pp * cp):
                continue
            dp = gpus // (tp * pp * cp)
            zeros = [z for z in zero_stages if (pp == 1 or z <= 1) and (dp > 1 or z == 0)]
            for mb in (m for m in microbatches if batch % (dp * m) == 0):
                for zero in zeros:
                    for rc in recompute:
                        yield dict(
                            tp=tp, pp=pp, dp=dp, zero=zero, microbatch=mb, recompute=rc, cp=cp
                        )


def _rank(lay: Layout) -> tuple:
    order = (lay.tp, lay.pp, lay.zero, lay.microbatch, memory.RECOMPUTE.index(lay.recompute))
    if lay.fits:
        return (0, -lay.tokens_per_s, lay.mem_per_gpu_bytes, order)
    return (1, lay.mem_per_gpu_bytes, -lay.tokens_per_s, order)


def evaluate(
    *,
    layers: int,
    hidden: int,
    heads: int,
    seq: int,
    vocab: int,
    gpus: int,
    global_batch: int,
    tp: int,
    pp: int,
    dp: int,
    zero: int,
    microbatch: int,
    recompute: str,
    gpus_per_node: int = 8,
    gpu: GPU | str = "A100 80GB",
    mfu: float = MFU,
    reserve: float = RESERVE,
    dp_overlap: float = 0.0,
    sequence_parallel: bool = False,
    optimizer: str = "adam",
    cp: int = 1,
    kv_heads: int | None = None,
) -> Layout:
    """One layout's memory (``memory.transformer_layout``) and predicted step (the module
    docstring's cost model); ``plan`` calls it for each candidate. ``cp``: GPUs sharing each
    sequence (context parallelism), ``kv_heads``: see ``plan``."""
    gpu = _device(gpu) if isinstance(gpu, str) else gpu
    if tp * pp * cp * dp != gpus or global_batch % (dp * microbatch) or seq % cp:
        raise ValueError(
            f"tp {tp} x pp {pp} x cp {cp} x dp {dp} must equal the {gpus} GPUs, dp x "
            f"micro-batch ({dp} x {microbatch}) divide the global batch {global_batch} and cp "
            f"the sequence {seq}"
        )
    m = global_batch // (dp * microbatch)
    model = dict(layers=layers, hidden=hidden, seq=seq, vocab=vocab)
    mem = memory.transformer_layout(
        **model,
        heads=heads,
        micro_batch=microbatch,
        tp=tp,
        pp=pp,
        dp=dp * cp,  # the GPUs holding the same parameters: ZeRO shards over all of them
        zero=zero,
        recompute=recompute,
        optimizer=optimizer,
        microbatches_in_flight=min(pp, m),
        sequence_parallel=sequence_parallel,
        cp=cp,
    )
    flops = iteration_flops(**model, batch=global_batch, recompute=recompute)
    compute = flops / (gpus * gpu.peak_flops * mfu)
    act_bytes = 2 * microbatch * seq / cp * hidden  # one micro-batch's b x s/cp x h, 16-bit
    nvlink, ib = LINKS[gpu.nvlink], LINKS[gpu.network]
    per_ar = nvlink.time("all_reduce", act_bytes, tp)
    tp_comm = (layers // pp) * m * (6 if recompute == "full" else 4) * per_ar
    bubble = theory_bubble(pp, m)
    pp_bubble = (compute + tp_comm) * bubble / (1 - bubble)
    hop = nvlink if gpus <= gpus_per_node else ib
    pp_comm = 2 * (m + pp - 1) * hop.time("p2p", act_bytes / tp, 2) if pp > 1 else 0.0
    psi = memory.stage_parameters(**model, tp=tp, pp=pp)
    replicas = dp * cp  # the gradients' reduction: every GPU holding the same parameters
    dp_link = _dp_link(tp, replicas, gpus_per_node, nvlink, ib)
    dp_comm = _dp_comm(2 * psi, replicas, zero, m, dp_link)
    kv = hidden * (kv_heads or heads) // heads
    shape = (layers // pp, m, microbatch, seq, hidden, kv)
    cp_comm = _cp_comm(*shape, tp, cp, recompute, gpu, mfu, gpus_per_node)
    step = compute + tp_comm + pp_bubble + pp_comm + (1 - dp_overlap) * dp_comm + cp_comm
    usable = gpu.memory_bytes * (1 - reserve)
    tokens = global_batch * seq
    return Layout(
        tp=tp,
        pp=pp,
        dp=dp,
        zero=zero,
        microbatch=microbatch,
        recompute=recompute,
        microbatches=m,
        mem_per_gpu_bytes=mem["total"],
        device_memory_bytes=usable,
        fits=mem["total"] <= usable,
        step_s=step,
        tokens_per_s=tokens / step,
        tflops_per_gpu=model_flops(**model, batch=global_batch) / (step * gpus) / 1e12,
        sc21_tflops_per_gpu=flops / (step * gpus) / 1e12,
        compute_s=compute,
        tp_comm_s=tp_comm,
        pp_bubble_s=pp_bubble,
        pp_comm_s=pp_comm,
        dp_comm_s=dp_comm,
        params_bytes=mem["params"],
        grads_bytes=mem["grads"],
        optimizer_bytes=mem["optimizer"],
        activations_bytes=mem["activations"],
        cp=cp,
        cp_comm_s=cp_comm,
    )


def ring_pass_s(link: AlphaBeta, block_bytes: float, n: int, block_compute_s: float = 0.0):
    """One pass of context parallelism's ring on ``n`` GPUs: n - 1 steps, each sending a block
    of ``block_bytes`` to the next GPU (a point-to-point message, alpha + S / beta) while the
    attention of the block in hand takes ``block_compute_s``; what stays exposed is
    (n - 1) * max(0, alpha + S / beta - block_compute_s). The ring hides behind compute when a
    block's attention outlasts its transfer (Liu et al. 2023, arXiv:2310.01889, section 3)."""
    if n == 1:
        return 0.0
    return (n - 1) * max(0.0, link.time("p2p", block_bytes, 2) - block_compute_s)


def _cp_comm(layers, m, b, seq, hidden, kv, tp, cp, recompute, gpu, mfu, per_node) -> float:
    """Seconds of context parallelism's ring per step not hidden by attention: per layer and
    micro-batch one forward pass of K and V (16-bit, ``kv`` wide: h under multi-head
    attention, h * kv_heads / heads under grouped-query), each GPU's tp share, b * s/cp of them;
    one backward pass carrying K, V and dK, dV (twice the bytes, beside twice the compute); a
    second forward pass under full recomputation. A block's attention: 4 b (s/cp)^2 h / tp
    FLOPs forward (one s/cp x s/cp tile), at ``mfu`` of the GPU's peak. The cp GPUs sit next to
    the tp ones (Megatron-LM's order): NVLink while tp * cp fits in a node, else InfiniBand."""
    if cp == 1:
        return 0.0
    link = LINKS[gpu.nvlink] if tp * cp <= per_node else LINKS[gpu.network]
    block = 2 * 2 * b * (seq / cp) * kv / tp  # K and V, 2 bytes each
    tile = 4 * b * (seq / cp) ** 2 * hidden / tp / (gpu.peak_flops * mfu)
    forward = ring_pass_s(link, block, cp, tile)
    backward = ring_pass_s(link, 2 * block, cp, 2 * tile)
    passes = forward * (2 if recompute == "full" else 1) + backward
    return layers * m * passes


def _dp_link(tp: int, dp: int, gpus_per_node: int, nvlink: AlphaBeta, ib: AlphaBeta) -> AlphaBeta:
    """The link a data-parallel group's ring runs at. Inside one node: NVLink. Across nodes:
    with Megatron-LM's rank order a node holds g = min(dp, gpus_per_node / tp) of the group's
    ranks, and NCCL runs one ring per InfiniBand port, so the group crosses nodes at g ports'
    bandwidth (no more than NVLink's)."""
    if tp * dp <= gpus_per_node:
        return nvlink
    g = min(dp, gpus_per_node // tp)
    return AlphaBeta(ib.alpha_s, min(nvlink.beta, g * ib.beta), f"{g} x ({ib.source})")


def _dp_comm(grad_bytes: float, dp: int, zero: int, m: int, link: AlphaBeta) -> float:
    """Seconds of data-parallel communication per step, for ``grad_bytes`` of 16-bit gradients
    (as many bytes of parameters) per GPU:

    * ZeRO-0 (plain DP) all-reduces the gradients once per step; a ring all-reduce is a
      reduce-scatter followed by an all-gather, so ZeRO-1, which reduce-scatters the gradients
      and all-gathers the updated parameters, moves the same bytes in the same time;
    * ZeRO-2 keeps only its shard of the gradients, so it reduce-scatters after each of the m
      micro-batches' backward;
    * ZeRO-3 also all-gathers each layer's parameters for each micro-batch's forward and again
      for its backward: 3 x the bytes of ZeRO-1 when m = 1 (the ZeRO paper's 1.5 x all-reduce),
      m times that with gradient accumulation. DeepSpeed overlaps much of this with compute;
      this model does not (``dp_overlap`` applies to it as to the rest)."""
    rs = link.time("reduce_scatter", grad_bytes, dp)
    ag = link.time("all_gather", grad_bytes, dp)
    if zero <= 1:
        return rs + ag
    if zero == 2:
        return m * rs + ag
    return m * (rs + 2 * ag)


def bytes_per_step(
    *,
    layers: int,
    hidden: int,
    seq: int,
    vocab: int,
    global_batch: int,
    tp: int,
    pp: int,
    dp: int,
    zero: int,
    microbatch: int,
    recompute: str,
) -> dict:
    """Bytes one GPU sends per step in ``evaluate``'s cost model, term by term (the ring
    convention ``labkit.wire`` counts with: the ``b`` coefficient of ``collectives.coefficients``
    times the message): ``tensor``, (L/pp) x m x 4 all-reduces (6 with full recomputation) of
    b x s x h 16-bit activations over tp; ``pipeline``, the 2 (m + pp - 1) hand-offs of b x s x
    h / tp it times (its critical path: a stage itself sends 2m or m); ``data``, the 16-bit
    gradients' reduce-scatter and all-gather over dp (ZeRO-2: a reduce-scatter per
    micro-batch; ZeRO-3: per micro-batch a reduce-scatter and two all-gathers), ``_dp_comm``'s
    terms. A dry run (``labkit.labs.dryrun``) counts what the code sends beside it."""
    m = global_batch // (dp * microbatch)
    act = 2 * microbatch * seq * hidden
    per_ar = coefficients("all_reduce", tp)[1] * act
    tensor = (layers // pp) * m * (6 if recompute == "full" else 4) * per_ar
    pipeline = 2 * (m + pp - 1) * act / tp if pp > 1 else 0.0
    grads = 2 * memory.stage_parameters(layers=layers, hidden=hidden, vocab=vocab, seq=seq,
                                        tp=tp, pp=pp)  # fmt: skip
    one = coefficients("reduce_scatter", dp)[1] * grads  # a reduce-scatter, or an all-gather
    data = {0: 2, 1: 2, 2: m + 1, 3: 3 * m}[zero] * one
    return {"tensor": tensor, "pipeline": pipeline, "data": data}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _device(name: str) -> GPU:
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}: choose one of {', '.join(DEVICES)}")
    return DEVICES[name]


def _check_plan(layers, hidden, heads, gpus, gpus_per_node, global_batch, mfu, reserve, overlap):
    memory._check_shape(layers=layers, hidden=hidden, heads=heads, tp=1, pp=1)
    if gpus < 1 or gpus_per_node < 1 or global_batch < 1:
        raise ValueError("gpus, gpus_per_node and global_batch must be at least 1")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        lower = gpus // gpus_per_node * gpus_per_node
        raise ValueError(
            f"{gpus} GPUs is not a whole number of {gpus_per_node}-GPU nodes: use "
            f"{lower} or {lower + gpus_per_node} GPUs (or another --gpus-per-node)"
        )
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu is a share of peak FLOP/s: give one in (0, 1], got {mfu}")
    if not 0 <= reserve < 1 or not 0 <= overlap <= 1:
        raise ValueError("reserve must be in [0, 1) and dp_overlap in [0, 1]")


def require_fit(layouts: Sequence[Layout]) -> Layout:
    """The best layout, or a ValueError saying what the smallest one would need."""
    if layouts and layouts[0].fits:
        return layouts[0]
    small = min(layouts, key=lambda lay: lay.mem_per_gpu_bytes)
    raise ValueError(
        f"no layout fits in {small.device_memory_bytes / GB:.1f} GB per GPU (device memory "
        f"less the reserve): the smallest, tp {small.tp} x pp {small.pp} x dp "
        f"{small.dp} ZeRO-{small.zero} with {small.recompute} recomputation, needs "
        f"{small.mem_per_gpu_bytes / GB:.1f} GB: add GPUs, choose a device with more memory, "
        "or a shorter sequence"
    )


def to_frame(layouts: Sequence[Layout]):
    """One row per layout (``Layout``'s fields), with GB and ms columns for reading."""
    import pandas as pd

    df = pd.DataFrame([lay.to_dict() for lay in layouts])
    if df.empty:
        return df
    df["mem_per_gpu_GB"] = df["mem_per_gpu_bytes"] / GB
    for col in ("step", "compute", "tp_comm", "pp_bubble", "pp_comm", "dp_comm", "cp_comm"):
        df[f"{col}_ms"] = 1e3 * df[f"{col}_s"]
    return df


def compare_sc21(device: str = "A100 80GB", mfu: float = MFU, **knobs):
    """Megatron-LM's weak-scaling table (``SC21``) beside the advisor, one row per model: the
    published layout and TFLOP/s per GPU; ``predicted_tflops``, the advisor's prediction for
    the published layout (its tp and pp, no ZeRO, full recomputation, the fastest micro-batch
    size: Table 1 does not give it); and the advisor's own best layout (``advisor_*``), its
    TFLOP/s per GPU in SC'21's convention (``advisor_tflops``) and in 6N's, and how much
    faster the model predicts it to be than the published layout (``predicted_speedup``, one
    prediction over another). ``published_step_s`` is the step the published TFLOP/s imply
    through the Appendix formula. Returns a pandas DataFrame."""
    import pandas as pd

    rows = []
    for row in SC21:
        args = dict(
            layers=row.layers,
            hidden=row.hidden,
            heads=row.heads,
            seq=row.seq,
            vocab=row.vocab,
            gpus=row.gpus,
            global_batch=row.global_batch,
            device=device,
            mfu=mfu,
            **knobs,
        )
        best = plan(**args)[0]
        theirs = plan(
            **args, tp_choices=[row.tp], pp_choices=[row.pp], zero_stages=(0,), recompute=("full",)
        )[0]
        flops = iteration_flops(
            layers=row.layers, hidden=row.hidden, seq=row.seq, vocab=row.vocab,
            batch=row.global_batch,
        )  # fmt: skip
        published_step = flops / (row.gpus * row.tflops_per_gpu * 1e12)
        rows.append(
            {
                "model": row.name,
                "params_b": row.params_b,
                "gpus": row.gpus,
                "global_batch": row.global_batch,
                "published_tp": row.tp,
                "published_pp": row.pp,
                "published_dp": row.dp,
                "published_tflops": row.tflops_per_gpu,
                "predicted_tflops": theirs.sc21_tflops_per_gpu,
                "advisor_tp": best.tp,
                "advisor_pp": best.pp,
                "advisor_dp": best.dp,
                "advisor_zero": best.zero,
                "advisor_microbatch": best.microbatch,
                "advisor_recompute": best.recompute,
                "advisor_tflops": best.sc21_tflops_per_gpu,
                "advisor_tflops_6n": best.tflops_per_gpu,
                "advisor_GB": best.mem_per_gpu_bytes / GB,
                "predicted_speedup": theirs.step_s / best.step_s,
                "published_step_s": published_step,
            }
        )
    df = pd.DataFrame(rows)
    df.attrs["source"] = SC21_SOURCE
    return df


# ---- a mixture of experts: the expert-parallel degree, and the all-to-all it costs ------------
#
# An MoE transformer (``memory.moe_parameters``) laid out with expert parallelism: ep GPUs share
# out each layer's experts, dp = gpus GPUs each train their shard of the batch (ep divides dp;
# no tensor or pipeline split here). Per MoE layer and micro-batch every GPU sends its tokens'
# rows to the experts' GPUs and gets the outputs back (GShard, Lepikhin et al. 2020,
# arXiv:2006.16668): two all-to-alls forward and their two gradients backward (and the forward
# pair again under full recomputation), each of b*s*k*cf rows of h 16-bit values per GPU.


@dataclass(frozen=True)
class MoEShape:
    """An MoE transformer by its shape (``memory.moe_parameters``), and where it is published."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    experts: int
    top_k: int
    vocab: int
    source: str = ""

    def parameters(self) -> dict:
        return memory.moe_parameters(
            layers=self.layers,
            hidden=self.hidden,
            heads=self.heads,
            kv_heads=self.kv_heads,
            ffn_hidden=self.ffn_hidden,
            experts=self.experts,
            top_k=self.top_k,
            vocab=self.vocab,
        )


MIXTRAL_8X7B = MoEShape(
    "Mixtral 8x7B", 32, 4096, 32, 8, 14336, 8, 2, 32000,
    "Jiang et al. 2024, 'Mixtral of Experts' (arXiv:2401.04088), Table 1: dim 4096, 32 layers, "
    "32 heads, 8 kv heads, hidden_dim 14336, vocab 32000, 8 experts, top 2; 46.7B parameters in "
    "all, 12.9B active per token (Mistral AI's announcement, December 2023)",
)  # fmt: skip


@dataclass(frozen=True)
class MoELayout:
    """One expert-parallel layout of an MoE model: bytes per GPU and the predicted step, its
    terms apart (``a2a_s``: the all-to-alls; ``a2a_bytes``: what one GPU hands them per step)."""

    ep: int
    dp: int
    zero: int
    microbatch: int
    microbatches: int
    mem_per_gpu_bytes: float
    device_memory_bytes: float
    fits: bool
    step_s: float
    tokens_per_s: float
    compute_s: float
    a2a_s: float
    dp_comm_s: float
    a2a_bytes: float
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float

    def to_dict(self) -> dict:
        return asdict(self)


def all_to_all_s(link: AlphaBeta, bytes_per_rank: float, n: int) -> float:
    """One all-to-all in which each of ``n`` ranks hands in ``bytes_per_rank`` and keeps 1/n of
    it: n-1 messages of S/n, ``(n-1) alpha + (n-1)/n S / beta`` (a pairwise exchange)."""
    return link.time("all_to_all", bytes_per_rank, n)


def moe_evaluate(
    shape: MoEShape,
    *,
    gpus: int,
    ep: int,
    seq: int,
    global_batch: int,
    microbatch: int,
    zero: int = 0,
    capacity_factor: float = 1.0,
    gpus_per_node: int = 8,
    gpu: GPU | str = "H100 SXM 80GB",
    mfu: float = MFU,
    reserve: float = RESERVE,
    optimizer: str = "adam",
) -> MoELayout:
    """Memory per GPU and the step of ``shape`` on ``gpus`` data-parallel GPUs, ``ep`` of them
    sharing out the experts, full activation recomputation:

    * memory: ``memory.moe_states`` (dense states over dp, experts / ep over dp / ep) and the
      activations of ``memory.stack_activations`` for the layers' shape (each layer's 2sbh
      input, one layer rebuilt; the rebuilt layer counted as a dense one of the same h);
    * compute: 8 x active parameters x tokens (forward, backward, the forward again) over
      ``gpus * peak * mfu``; the attention's s^2 FLOPs are left out;
    * all-to-alls: 6 per layer and micro-batch of b*s*k*cf*h*2 bytes per GPU over the ep GPUs
      (``all_to_all_s``), on NVLink when ep fits in a node, else the GPU's InfiniBand port;
    * data parallel: the dense gradients (2 bytes each) over dp, the experts' over the dp / ep
      GPUs that hold the same ones (``_dp_comm``'s ZeRO rules), not overlapped."""
    gpu = _device(gpu) if isinstance(gpu, str) else gpu
    dp = gpus
    if dp % ep or shape.experts % ep or global_batch % (dp * microbatch):
        raise ValueError(
            f"ep {ep} must divide the {gpus} GPUs and the {shape.experts} experts, and dp x "
            f"micro-batch ({dp} x {microbatch}) the global batch {global_batch}"
        )
    p = shape.parameters()
    m = global_batch // (dp * microbatch)
    states = memory.moe_states(
        p["dense"], p["experts"], ep=ep, dp=dp, zero=zero, optimizer=optimizer
    )
    acts = memory.stack_activations(
        layers=shape.layers, seq=seq, micro_batch=microbatch, hidden=shape.hidden,
        heads=shape.heads, recompute="full",
    )  # fmt: skip
    tokens = global_batch * seq
    compute = 8 * p["active"] * tokens / (gpus * gpu.peak_flops * mfu)
    nvlink, ib = LINKS[gpu.nvlink], LINKS[gpu.network]
    rows = microbatch * seq * shape.top_k * capacity_factor
    per_a2a = 2 * rows * shape.hidden  # 16-bit
    link = nvlink if ep <= gpus_per_node else ib
    a2a = 6 * shape.layers * m * all_to_all_s(link, per_a2a, ep)
    dp_link = _dp_link(1, dp, gpus_per_node, nvlink, ib)
    dp_comm = _dp_comm(2 * p["dense"], dp, zero, m, dp_link)
    if dp // ep > 1:
        dp_comm += _dp_comm(2 * p["experts"] / ep, dp // ep, zero, m, dp_link)
    step = compute + a2a + dp_comm
    mem = states["total"] + acts
    usable = gpu.memory_bytes * (1 - reserve)
    return MoELayout(
        ep=ep,
        dp=dp,
        zero=zero,
        microbatch=microbatch,
        microbatches=m,
        mem_per_gpu_bytes=mem,
        device_memory_bytes=usable,
        fits=mem <= usable,
        step_s=step,
        tokens_per_s=tokens / step,
        compute_s=compute,
        a2a_s=a2a,
        dp_comm_s=dp_comm,
        a2a_bytes=6 * shape.layers * m * per_a2a,
        params_bytes=states["params"],
        grads_bytes=states["grads"],
        optimizer_bytes=states["optimizer"],
        activations_bytes=acts,
    )


def moe_plan(
    shape: MoEShape,
    *,
    gpus: int,
    seq: int,
    global_batch: int,
    zero_stages: Sequence[int] = (0, 1, 2, 3),
    microbatches: Sequence[int] = MICROBATCHES,
    **knobs,
) -> list[MoELayout]:
    """Every expert-parallel degree (the divisors of ``gpus`` that divide the experts), ZeRO
    stage and micro-batch of ``moe_evaluate``, best first as ``plan`` ranks them: the fastest
    that fits, then the rest, smallest first."""
    out = [
        moe_evaluate(
            shape, gpus=gpus, ep=ep, seq=seq, global_batch=global_batch, microbatch=mb,
            zero=z, **knobs,
        )
        for ep in _divisors(gpus)
        if shape.experts % ep == 0
        for mb in microbatches
        if global_batch % (gpus * mb) == 0
        for z in zero_stages
        if gpus > 1 or z == 0
    ]  # fmt: skip
    if not out:
        raise ValueError(
            f"no micro-batch of {', '.join(map(str, microbatches))} splits a global batch of "
            f"{global_batch} over {gpus} GPUs: choose a multiple of {gpus}"
        )
    return sorted(out, key=_moe_rank)


def _moe_rank(lay: MoELayout) -> tuple:
    order = (lay.ep, lay.zero, lay.microbatch)
    if lay.fits:
        return (0, -lay.tokens_per_s, lay.mem_per_gpu_bytes, order)
    return (1, lay.mem_per_gpu_bytes, -lay.tokens_per_s, order)
