"""Checkpoints that a killed run can trust: atomic, validated, and enough to continue exactly.

A checkpoint holds what the next optimizer step depends on: the model, the optimizer (momentum
buffers), how many steps were taken, where each rank is in the data (sampler epoch and the
offset into it, in samples of the global batch, so any world size can find its place), every
random stream (torch CPU, CUDA if present, Python, NumPy) and the config fingerprint and world
size it was written under. Rank 0 writes it (data-parallel replicas are identical).

The file is a one-line header (magic, format version, payload length, SHA-256) and a
``torch.save`` payload. ``save`` writes a temporary file in the same folder, fsyncs it and
renames it over the old one (a rename within one file system is atomic), then fsyncs the
folder: a crash, a full disk or a folder that refuses writes leaves the previous checkpoint as
it was. ``load`` checks the header, the length and the digest before unpickling anything (with
``weights_only``), so a truncated or foreign file raises ``CheckpointError`` and never half-loads.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

MAGIC = "labkit-checkpoint"
FORMAT = 1
FILENAME = "checkpoint.pt"
TIMELINE = "timeline.jsonl"
# The fields that decide the trajectory of a run: a checkpoint written under other values of
# these cannot continue this run. World size, accumulation, strategy (among the data-parallel
# ones), steps, threads and timeouts may change between attempts: the update stays the same.
FINGERPRINT_FIELDS = (
    "model",
    "in_features",
    "width",
    "depth",
    "classes",
    "dataset_size",
    "seed",
    "lr",
    "global_batch",
    "warmup",
    "sync_batchnorm",
    "heads",
    "seq_len",
)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, or read back as a whole."""


def fingerprint(cfg) -> str:
    """A short digest of the config fields that decide the run's trajectory."""
    fields = {name: getattr(cfg, name) for name in FINGERPRINT_FIELDS}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def path_in(folder: str) -> str:
    return os.path.join(folder, FILENAME)


def exists(folder: str | None) -> bool:
    return bool(folder) and os.path.exists(path_in(folder))


# ---- random streams ------------------------------------------------------------------------


def rng_state() -> dict:
    """This process's random streams, as plain tensors and lists (safe for weights_only)."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": _tuples_to_lists(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
    except ImportError:  # numpy is optional for a training run
        pass
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_lists_to_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def _tuples_to_lists(x):
    return [_tuples_to_lists(v) for v in x] if isinstance(x, (tuple, list)) else x


def _lists_to_tuples(x):
    return tuple(_lists_to_tuples(v) for v in x) if isinstance(x, (tuple, list)) else x


# ---- the file ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    """What a run continues from (``load``'s answer)."""

    step: int  # optimizer steps taken (warm-up ones included)
    epoch: int  # the sampler's epoch the next step reads from
    offset: int  # samples of that epoch already trained (a multiple of the batch)
    world_size: int  # the world size that wrote it
    fingerprint: str
    model: dict
    optimizer: dict
    rng: list  # one ``rng_state()`` per rank that wrote it
    extra: dict  # the caller's (e.g. records so far)
    path: str = ""


def save(
    folder: str,
    *,
    step: int,
    epoch: int,
    offset: int,
    world_size: int,
    cfg,
    model,
    optimizer,
    rng: list[dict],
    extra: dict | None = None,
) -> str:
    """Write the checkpoint atomically into ``folder``; return its path.

    Raises ``CheckpointError`` (the previous checkpoint untouched) when the folder cannot be
    written to or the disk fills up."""
    payload = {
        "step": step,
        "epoch": epoch,
        "offset": offset,
        "world_size": world_size,
        "fingerprint": fingerprint(cfg),
        "model": _cpu(model.state_dict()),
        "optimizer": _cpu(optimizer.state_dict()),
        "rng": rng,
        "extra": extra or {},
        "written": time.time(),
    }
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    header = (
        json.dumps(
            {
                "magic": MAGIC,
                "format": FORMAT,
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        ).encode()
        + b"\n"
    )
    final = path_in(folder)
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, final)
        tmp = None
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)  # and the rename itself survives a power cut
        finally:
            os.close(dfd)
    except OSError as exc:
        raise CheckpointError(
            f"could not write a checkpoint in {folder} ({exc.strerror or exc}); "
            f"the previous one, if any, is intact: free space or fix the "
            f"folder's permissions"
        ) from exc
    finally:
        if tmp is not None and os.path.exists(tmp):
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return final


def load(folder_or_file: str, cfg=None) -> Checkpoint:
    """Read and validate a checkpoint (a folder holding one, or the file itself).

    With ``cfg``, also check that it was written by a run of the same trajectory."""
    path = folder_or_file if os.path.isfile(folder_or_file) else path_in(folder_or_file)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from exc
    head, sep, data = raw.partition(b"\n")
    try:
        header = json.loads(head) if sep else None
    except (ValueError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        raise CheckpointError(
            f"{path} is not a labkit checkpoint (no labkit header): delete it "
            f"or point checkpoint_dir at another folder"
        )
    if header.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} has checkpoint format {header.get('format')}, this labkit "
            f"reads format {FORMAT}"
        )
    if len(data) != header.get("bytes"):
        raise CheckpointError(
            f"{path} is truncated or damaged: {len(data)} of "
            f"{header.get('bytes')} payload bytes; nothing was loaded"
        )
    if hashlib.sha256(data).hexdigest() != header.get("sha256"):
        raise CheckpointError(
            f"{path} is damaged: its content does not match its SHA-256; nothing was loaded"
        )
    payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if cfg is not None and payload["fingerprint"] != fingerprint(cfg):
        raise CheckpointError(
            f"{path} was written by a different run (config fingerprint {payload['fingerprint']}, "
            f"this run's is {fingerprint(cfg)}; it covers {', '.join(FINGERPRINT_FIELDS)}): use "
            f"the same settings to resume, or another checkpoint_dir to start afresh"
        )
    return Checkpoint(
        step=payload["step"],
        epoch=payload["epoch"],
        offset=payload["offset"],
        world_size=payload["world_size"],
        fingerprint=payload["fingerprint"],
        model=payload["model"],
        optimizer=payload["optimizer"],
        rng=payload["rng"],
        extra=payload["extra"],
        path=path,
    )


def _cpu(state):
    if isinstance(state, torch.Tensor):
        return state.detach().cpu().clone()
    if isinstance(state, dict):
        return {k: _cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_cpu(v) for v in state)
    return state


# ---- the timeline: one line per step, across restarts and world sizes ------------------------


def append_timeline(folder: str, **row) -> None:
    """Append one JSON line to ``folder``/timeline.jsonl (rank 0 writes; a reader can follow a
    run live, across the attempts torchrun starts). Best effort: a failed append is skipped."""
    row.setdefault("time", time.time())
    try:
        with open(os.path.join(folder, TIMELINE), "a") as f:
            f.write(json.dumps(row) + "\n")
    except OSError:
        pass


def read_timeline(folder: str) -> list[dict]:
    """The rows written so far (a half-written last line, from a kill, is skipped)."""
    try:
        with open(os.path.join(folder, TIMELINE)) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


# ---- the training loop's side ----------------------------------------------------------------


def restart_count() -> int:
    """How many times torchrun restarted this worker group (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


class Resume:
    """Checkpointing as a knob of the shared loop (``cfg.checkpoint_dir``).

    ``start()`` continues from the folder's checkpoint if there is one (model, optimizer, data
    position, random streams) and returns the optimizer steps already taken; ``after_step``
    appends the step to the timeline (global-batch loss, world size, attempt: which start of
    the group in this folder trained it) and writes a checkpoint every ``cfg.checkpoint_every``
    steps and after the last one. The data position is kept in samples of the global batch, so
    a run can continue at another world size: the same global batch is re-sharded over the
    ranks there are now.
    """

    def __init__(self, cfg, ctx, model, optimizer, data, notes: list[str]):
        if not hasattr(data, "seek"):
            raise ValueError(
                "checkpoint_dir needs labkit's data stream (labkit.data.batches) "
                "to find its place again when resuming"
            )
        self.cfg, self.ctx, self.model, self.optimizer, self.data = cfg, ctx, model, optimizer, data
        self.notes, self.folder = notes, cfg.checkpoint_dir
        self.per_step = data.loader.batch_size * ctx.world_size * cfg.accumulate  # = global batch
        self.attempt = 0  # the group's start in this folder: 0, 1, 2... (start())
        self.stopping = False
        # Under torchrun, a membership change (a node joins or leaves) or a stop arrives as
        # SIGTERM, to the leaving node's workers only when a node leaves: a rank that gets it
        # finishes its step, writes a checkpoint itself (data-parallel replicas are identical,
        # so any rank can) and exits, so nothing is lost.
        if "TORCHELASTIC_RUN_ID" in os.environ:
            import signal
            import threading

            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, signum, frame) -> None:
        self.stopping = True

    def start(self) -> int:
        step, resumed = 0, None
        if exists(self.folder):
            ck = load(self.folder, self.cfg)
            self.model.load_state_dict(ck.model)
            self.optimizer.load_state_dict(ck.optimizer)
            per_epoch = len(self.data.loader) // self.cfg.accumulate * self.per_step
            if ck.offset % self.per_step or ck.offset > per_epoch:
                raise CheckpointError(
                    f"{ck.path} stopped {ck.offset} samples into epoch "
                    f"{ck.epoch}, which is not a whole number of global "
                    f"batches of {self.per_step} here"
                )
            if ck.offset == per_epoch:  # written after an epoch's last batch
                ck = Checkpoint(**{**ck.__dict__, "epoch": ck.epoch + 1, "offset": 0})
            self.data.seek(ck.epoch, ck.offset // self.per_step * self.cfg.accumulate)
            if (
                ck.world_size == self.ctx.world_size
                and self.ctx.rank < len(ck.rng)
                and ck.rng[self.ctx.rank] is not None
            ):
                set_rng_state(ck.rng[self.ctx.rank])
            else:  # streams cannot be split or merged: reseed, say so
                torch.manual_seed(self.cfg.seed + 1000 * ck.step + self.ctx.rank)
                self.notes.append(
                    f"resumed at world size {self.ctx.world_size} from a "
                    f"checkpoint written at world size {ck.world_size} with "
                    f"{len(ck.rng)} rank(s)' random streams: the others (dropout) "
                    f"were reseeded; the data and update are the same"
                )
            step, resumed = ck.step, ck.step
            if step >= self.cfg.warmup + self.cfg.steps:
                self.notes.append(
                    f"the checkpoint in {self.folder} is at step {step}, this run "
                    f"ends at {self.cfg.warmup + self.cfg.steps}: nothing was left "
                    f"to train (raise steps, or use another checkpoint_dir)"
                )
        # One number for the whole job: torchrun's restart count is per agent, and a membership
        # change restarts workers without counting; every start of the group counts here.
        if self.ctx.is_main:
            os.makedirs(self.folder, exist_ok=True)
            self.attempt = sum(r.get("event") == "start" for r in read_timeline(self.folder))
        self.attempt = _gather(self.attempt, self.ctx)[0]
        if self.ctx.is_main:
            append_timeline(
                self.folder,
                event="start",
                attempt=self.attempt,
                world_size=self.ctx.world_size,
                resumed_from=resumed,
                restarts=restart_count(),
            )
        return step

    def after_step(
        self, done: int, total: int, shard_loss: float, samples: int, step_s: float
    ) -> None:
        """``done`` optimizer steps taken (this one included) out of ``total``."""
        loss, samples = self._global_loss(shard_loss, samples)
        if self.ctx.is_main:
            append_timeline(
                self.folder,
                event="step",
                attempt=self.attempt,
                step=done,
                world_size=self.ctx.world_size,
                loss=loss,
                samples=samples,
                step_s=step_s,
            )
        every = self.cfg.checkpoint_every
        if done == total or (every and done % every == 0):
            self.save(done)
        elif self.stopping:  # no collective here: the peers may be stopping too
            self.save(done, alone=True)
        if self.stopping:
            append_timeline(
                self.folder, event="stopped", attempt=self.attempt, step=done, rank=self.ctx.rank
            )
            raise SystemExit(128 + 15)

    def save(self, done: int, alone: bool = False) -> None:
        """Rank 0 writes, with every rank's random streams gathered first; ``alone``: this
        rank writes with its own streams only (the others are reseeded on resume)."""
        if alone:
            rng = [None] * self.ctx.world_size
            rng[self.ctx.rank] = rng_state()
        else:
            rng = _gather(rng_state(), self.ctx)
            if not self.ctx.is_main:
                return
        epoch, index = self.data.epoch, self.data.index
        try:
            save(
                self.folder,
                step=done,
                epoch=epoch,
                offset=index // self.cfg.accumulate * self.per_step,
                world_size=self.ctx.world_size,
                cfg=self.cfg,
                model=self.model,
                optimizer=self.optimizer,
                rng=rng,
            )
            append_timeline(self.folder, event="checkpoint", attempt=self.attempt, step=done)
        except CheckpointError as exc:  # training goes on; the last good checkpoint stays
            import sys

            print(f"labkit: warning: {exc}", file=sys.stderr, flush=True)
            self.notes.append(f"step {done}: {exc}")
            append_timeline(
                self.folder,
                event="checkpoint_failed",
                attempt=self.attempt,
                step=done,
                error=str(exc),
            )

    def _global_loss(self, shard_loss: float, samples: int) -> tuple[float, int]:
        if not self.ctx.distributed:
            return shard_loss, samples
        import torch.distributed as dist

        t = torch.tensor(
            [shard_loss * samples, float(samples)], dtype=torch.float64, device=self.ctx.device
        )
        dist.all_reduce(t)
        return float(t[0] / t[1]), int(t[1])


def _gather(obj, ctx) -> list:
    if not ctx.distributed:
        return [obj]
    import torch.distributed as dist

    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out
