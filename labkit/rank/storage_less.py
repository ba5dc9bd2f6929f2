"""One rank's real code on tensors without storage: what a dry run runs inside.

torch's ``FakeTensorMode`` gives every tensor a shape, a dtype and a size in bytes but no data, so
a 70B model's step runs in seconds on a laptop; torch's fake process group (``labkit.dist.
fake_rank``) lets a collective return at once. Together they run a strategy's own code as one
rank of any world size. Four things they leave out, which ``storage_less()`` puts back:

* **the byte hooks.** A collective on storage-less tensors runs torch's meta kernel
  (``torch.distributed._meta_registrations``), which never reaches the process group, so the
  hooks ``labkit.wire`` registers on it would count nothing. Here a ``c10d`` operation is sent
  to its CPU kernel (the one a real CPU rank runs, ``Ops.cpp``) with the storage-less tensors:
  that kernel fires the group's hooks with the same arguments as in a real run and hands the
  fake backend tensors it never reads. A functional collective (DTensor's) gets its result from
  the fake mode and fires the ``c10d`` operation that its real kernel issues.
* **finished work.** DDP's reducer reads each bucket's all-reduced tensor from the work's
  future; the fake backend's futures hold None. Here they hold the tensors handed in.
* **bookkeeping integers.** A device mesh lays out its ranks in an ``arange`` tensor and reads
  it back with ``tolist()``; a ``DistributedSampler`` draws its order with ``randperm``. Integer
  tensors made from Python values, and every operation whose tensor arguments are all real,
  run for real (they are a few hundred bytes, never the model's activations).
* **values.** A number read out of a tensor with no data (a loss for the record, a gradient
  scaler's overflow flag) reads 0; ``reads`` counts them.

``patches()`` holds the per-strategy handling the fake process group needs, each with why
(``NOTES``): DDP's check that every rank's parameters have the same shapes reads their data
(skipped: every rank here is built from the same code); DDP's calibration times a backward
(skipped: there is nothing to time); FSDP2 makes 1 tensor per rank for each parameter when it
shards it (made lazily: the same shards, without a thousand tensors per parameter); ``.to()``
of a model already on its device swaps every parameter, which the fake mode forbids (skipped).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from unittest import mock

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes

from ..dist import RankContext, cleanup

NOTES = {
    "ddp_verify": "DDP's check that every rank's parameters have the same shapes reads their "
    "data: skipped (every rank here is built by the same code)",
    "calibration": "DDP's calibration (a backward timed without communication) skipped: a "
    "dry run times nothing",
    "fsdp_chunks": "FSDP2's per-rank chunks made lazily (the same shards; torch.chunk would "
    "make one tensor per rank for every parameter)",
    "module_to": "Module.to() of a model already on the device it is sent to returns it as it "
    "is (torch would swap every storage-less parameter, which the fake mode forbids)",
    "dtensor_tracing": "DTensor takes a fake mode for tracing and then caches nothing: told it "
    "is not tracing (its plans are cached as in a real run)",
}

_F = torch.ops._c10d_functional
# the functional collectives (DTensor's), whose real kernels call the process group; the rest
# of the namespace (waiting on one, wrapping its result for autograd) sends nothing
_FUNCTIONAL = {
    _F.all_reduce, _F.all_reduce_, _F.all_reduce_coalesced, _F.all_reduce_coalesced_,
    _F.all_gather_into_tensor, _F.all_gather_into_tensor_out,
    _F.all_gather_into_tensor_coalesced, _F.reduce_scatter_tensor, _F.reduce_scatter_tensor_out,
    _F.reduce_scatter_tensor_coalesced, _F.all_to_all_single, _F.broadcast, _F.broadcast_,
    _F.isend, _F.irecv, _F.batch_p2p_ops,
}  # fmt: skip
_SCALAR = torch.ops.aten._local_scalar_dense.default
_DEVICE = torch.ops.prim.device.default
_PYTHON = torch._C.DispatchKeySet(torch._C.DispatchKey.Python)
_INTEGER = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)


class StorageLess(FakeTensorMode):
    """``FakeTensorMode`` with what it leaves out put back (see the module docstring): one mode,
    so each operation is dispatched to Python once. ``reads``: numbers read out of tensors
    without data."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and type(args[0]) is FakeTensor:  # C++ asking a tensor its device:
            return _fake_device(args[0])  # half of all calls
        kwargs = kwargs or {}
        fake = super().__torch_dispatch__
        if types:  # tensors without data (FakeTensor) or wrapping them (DTensor): the fake
            namespace = func.namespace  # mode's, but for three kinds of operation
            if namespace == "aten":
                if func is _SCALAR and isinstance(args[0], FakeTensor):  # a number read out
                    self.reads += 1  # of a tensor without data
                    return False if args[0].dtype == torch.bool else 0
                return fake(func, types, args, kwargs)
            if namespace == "c10d":
                return self._collective(func, args, kwargs)
            if namespace == "_c10d_functional" and func.overloadpacket in _FUNCTIONAL:
                out = fake(func, types, args, kwargs)  # the result's shape
                if out is not NotImplemented:  # (a DTensor's: once it is unwrapped)
                    self._fire_functional(func, args, out)
                return out
            return fake(func, types, args, kwargs)
        # plain tensors only (bookkeeping: a mesh's ranks, a sampler's order), or none at all
        if func.namespace == "c10d":
            return self._collective(func, args, kwargs)
        if _has_tensor(args, kwargs) or _integer_factory(func, args, kwargs):
            with _disable_current_modes():
                return func(*args, **kwargs)
        return fake(func, types, args, kwargs)  # a factory of floating-point tensors

    def _collective(self, func, args, kwargs):
        """The CPU kernel with the storage-less tensors: it fires the group's hooks and calls
        the backend (``DryBackend``), which reads nothing and returns finished work."""
        with _disable_current_modes(), torch._C._ExcludeDispatchKeyGuard(_PYTHON):
            return func(*args, **kwargs)

    def _fire_functional(self, func, args, out) -> None:
        """What a functional collective's real kernel does after making its output
        (``_c10d_functional``'s C++: an all-reduce of a clone in place, an all-gather into a new
        tensor, ...): the same call on the same group, so its hooks see it; the backend reads
        nothing. The reduce operation does not change what the hooks count: the default."""
        from torch._C._distributed_c10d import _resolve_process_group

        name = func._overloadpacket.__name__
        group = args[-1]  # a group's name, or (not tracing) the group itself
        pg = _resolve_process_group(group) if isinstance(group, str) else group
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        with _disable_current_modes(), torch._C._ExcludeDispatchKeyGuard(_PYTHON):
            if name.startswith("all_reduce"):
                for t in outs:  # the coalesced form: one all-reduce per tensor, as gloo's
                    pg.allreduce([t])
            elif name.startswith("all_gather_into_tensor"):
                for o, i in zip(outs, _inputs(args[0])):
                    pg._allgather_base(o, i)
            elif name.startswith("reduce_scatter_tensor"):
                for o, i in zip(outs, _inputs(args[0])):
                    pg._reduce_scatter_base(o, i)
            elif name == "all_to_all_single":
                pg.alltoall_base(out, args[0], list(args[1]), list(args[2]))
            elif name.startswith("broadcast"):
                pg.broadcast(out, args[1])
            else:
                raise NotImplementedError(
                    f"the dry run does not count {func} yet: add it to StorageLess._fire_functional"
                )


def _fake_device(t: FakeTensor) -> torch.device:
    """The device a fake tensor reports, as ``FakeTensor.__torch_dispatch__`` answers
    ``prim.device`` without a trip through the mode (its private fields: written for torch
    2.14)."""
    return torch.device("meta") if t.fake_mode.in_kernel_invocation else t.fake_device


def _inputs(arg) -> list:
    return list(arg) if isinstance(arg, (list, tuple)) else [arg]


def _has_tensor(args, kwargs) -> bool:
    """Any tensor among the arguments (one level of lists deep: ``cat``'s, a collective's)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) or (
            isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a)
        ):
            return True
    return False


def _integer_factory(func, args, kwargs) -> bool:
    """A factory of integer tensors from Python values (``arange``, ``randperm``): bookkeeping
    (a mesh's rank layout, a sampler's order, a rank's positions), made for real."""
    if func.overloadpacket in (torch.ops.aten.randperm,):
        return True
    if func.overloadpacket is not torch.ops.aten.arange:
        return False
    dtype = kwargs.get("dtype")  # unset: integer when every bound is an integer, as torch says
    return dtype in _INTEGER or (dtype is None and all(isinstance(a, int) for a in args))


def _done(value) -> dist.Work:
    """A finished work whose future holds ``value`` (what a real backend's holds)."""
    from torch._C._distributed_c10d import _create_work_from_future

    future = torch.futures.Future()
    future.set_result(value)
    return _create_work_from_future(future)


class DryBackend(_C10dBackend):
    """A process-group backend that sends nothing and reads no tensor: every operation returns
    at once, its work finished, its future holding the output tensors (torch's fake backend
    writes into some outputs, which crashes on tensors without storage, and its futures hold
    None). Registered as ``BACKEND``; ``rank(r, n)`` sets it up as rank r of n."""

    # what torch asks a backend before it coalesces or splits: none of it (read as attributes:
    # the binding looks them up on the Python object, and a property would ask C++ again)
    supports_coalescing = supports_splitting = supports_time_estimate = False
    supports_shrinking = supports_reconfigure = supports_window = False

    def getBackendName(self) -> str:
        return BACKEND

    def broadcast(self, tensors, opts):
        return _done(tensors)

    def allreduce(self, tensors, opts):
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts):
        return _done(tensors)

    def reduce(self, tensors, opts):
        return _done(tensors)

    def allgather(self, outputs, inputs, opts):
        return _done(outputs)

    def all_gather_single(self, output, input, opts):
        return _done([output])

    def allgather_coalesced(self, outputs, inputs, opts):
        return _done(outputs)

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        return _done(outputs)

    def gather(self, outputs, inputs, opts):
        return _done(outputs)

    def scatter(self, outputs, inputs, opts):
        return _done(outputs)

    def reduce_scatter(self, outputs, inputs, opts):
        return _done(outputs)

    def reduce_scatter_single(self, output, input, opts):
        return _done([output])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        return _done(outputs)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts):
        return _done([output])

    def alltoall(self, outputs, inputs, opts):
        return _done(outputs)

    def send(self, tensors, dst, tag):
        return _done(tensors)

    def recv(self, tensors, src, tag):
        return _done(tensors)

    def recv_anysource(self, tensors, tag):
        return _done(tensors)

    def barrier(self, opts):
        return _done([])


BACKEND = "labkit_dry"
if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(
        BACKEND, lambda store, rank, size, timeout: DryBackend(rank, size), devices=["cpu"]
    )


@contextmanager
def rank(rank: int, world_size: int) -> Iterator[RankContext]:
    """Be rank ``rank`` of ``world_size`` in this process, on ``DryBackend``: every group made
    here (a device mesh's, DDP's) has its hooks, and its collectives return at once. The group
    is destroyed on leaving."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
    if dist.is_initialized():
        raise RuntimeError(
            "a process group is already set up in this process: call labkit.cleanup() first"
        )
    hook = sys.excepthook  # init_process_group wraps it with a "[rankN]" prefix, once per call
    dist.init_process_group(BACKEND, store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield RankContext(rank, rank, world_size, torch.device("cpu"), BACKEND)
    finally:
        cleanup()
        forget_meshes()
        sys.excepthook = hook


def forget_meshes() -> None:
    """Empty DTensor's caches of sharding and redistribution plans. They know a device mesh by
    its layout, not by its process groups, so the next rank run in this process (a new world,
    new groups, the same layout) would be handed plans whose collectives name the old groups.
    Written for torch 2.14's private caches."""
    from torch.distributed.tensor import _collective_utils, _redistribute
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python cache and the C++ fast path's
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


@contextmanager
def storage_less():
    """Inside: every floating-point tensor made has no storage (``FakeTensorMode``), collectives
    are counted by the groups' hooks, and the per-strategy handling of ``patches()`` is on.
    Yields the ``StorageLess`` mode (its ``reads``)."""
    mode = StorageLess()
    with ExitStack() as stack:
        stack.enter_context(patches())
        stack.enter_context(mode)
        yield mode


@contextmanager
def patches():
    """The per-strategy handling the fake process group needs (``NOTES`` says why)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param
    from torch.nn.parallel import distributed as ddp

    from . import watch

    with ExitStack() as stack:
        stack.enter_context(
            mock.patch.object(ddp, "_verify_param_shape_across_processes", lambda *a, **k: None)
        )
        stack.enter_context(mock.patch.object(watch.Calibration, "step_start", lambda s, i: False))
        stack.enter_context(mock.patch.object(_fsdp_param, "_chunk_with_empty", lazy_chunks))
        stack.enter_context(mock.patch.object(torch.nn.Module, "to", _to(torch.nn.Module.to)))
        for module in _TRACING_READERS:
            module = importlib.import_module(module)
            stack.enter_context(
                mock.patch.object(module, "_are_we_tracing", _not_tracing(module._are_we_tracing))
            )
        yield


# the modules that read ``_are_we_tracing`` by name (torch 2.14)
_TRACING_READERS = (
    "torch.distributed._functional_collectives",
    "torch.distributed.tensor._collective_utils",
    "torch.distributed.tensor._decompositions",
    "torch.distributed.tensor._dispatch",
    "torch.distributed.tensor._redistribute",
    "torch.distributed.tensor._sharding_prop",
)


def _not_tracing(original):
    """``_are_we_tracing`` that does not count the dry run's fake mode as tracing (``NOTES``):
    DTensor then caches its sharding and redistribution plans, and a functional collective
    returns the tensor it waits on, as in a real run."""

    def are_we_tracing() -> bool:
        fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
        if isinstance(fake, StorageLess):
            return False
        return original()

    return are_we_tracing


def _to(original):
    """``Module.to`` that leaves a storage-less model where it already is (``NOTES``)."""

    def to(module, *args, **kwargs):
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*module.parameters(), *module.buffers()]
        if (
            dtype is None
            and memory_format is None
            and all(isinstance(t, FakeTensor) for t in tensors)
            and all(device is None or t.device == torch.device(device) for t in tensors)
        ):
            return module
        return original(module, *args, **kwargs)

    return to


class lazy_chunks:
    """``torch.chunk(tensor, n, dim)`` padded with empty tensors to ``n`` (FSDP2's
    ``_chunk_with_empty``), each chunk made when it is read: FSDP2 reads two of them."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int):
        self.tensor, self.n, self.dim = tensor, num_chunks, dim
        size = tensor.shape[dim]
        self.step = -(-size // num_chunks) if size else 0  # torch.chunk's chunk size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not -self.n <= i < self.n:
            raise IndexError(i)
        i %= self.n
        start, size = i * self.step, self.tensor.shape[self.dim]
        if size == 0:  # torch.chunk gives the empty tensor itself as its one chunk
            return self.tensor if i == 0 else self.tensor.new_empty(0)
        if start >= size:  # torch.chunk made fewer chunks: FSDP pads with empty tensors
            return self[0].new_empty(0)
        return self.tensor.narrow(self.dim, start, min(self.step, size - start))

    def __iter__(self):
        return (self[i] for i in range(self.n))
