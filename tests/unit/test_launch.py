"""labkit.launch: what it refuses before any rank starts (bad sizes, devices, arguments that
cannot be sent), each refusal naming the fix.

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_launch.py."""

from __future__ import annotations

import threading

import pytest
import torch

from labkit import launch
from tests.helpers import ranks
from tests.helpers.procs import live_ranks

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")
HAS_GPU = torch.cuda.is_available() and torch.cuda.device_count() > 0


# ---- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [0, -1, 1.5, True])
def test_world_size_must_be_a_whole_number_at_least_one(world_size):
    with pytest.raises(ValueError, match="world_size must be a whole number >= 1"):
        launch(ranks.whoami, world_size)


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        launch(ranks.whoami, 2, timeout_s=0)


def test_more_gpu_ranks_than_gpus_is_refused():
    if HAS_GPU:
        n = torch.cuda.device_count() + 1
        with pytest.raises(ValueError, match=f"lower world_size to {n - 1}"):
            launch(ranks.whoami, n, device="cuda")
    else:
        with pytest.raises(ValueError, match="no usable GPU: use device='cpu'"):
            launch(ranks.whoami, 2, device="cuda")
    assert not live_ranks()


def test_unknown_device_is_refused():
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu' or 'cuda'"):
        launch(ranks.whoami, 2, device="tpu")


def test_an_argument_that_cannot_be_sent_is_named():
    with pytest.raises(TypeError, match=r"argument 1 cannot be sent to the rank processes"):
        launch(ranks.raise_on, 2, args=(0, threading.Lock()))
    gen = (i for i in range(3))
    with pytest.raises(TypeError, match=r"keyword argument 'numbers' cannot be sent"):
        launch(ranks.raise_on, 2, args=(0, "x"), kwargs={"numbers": gen})


def test_a_function_closing_over_a_lock_is_named():
    lock = threading.Lock()

    def uses_lock(ctx):
        with lock:
            return ctx.rank

    with pytest.raises(TypeError, match=r"the function 'uses_lock' cannot be sent"):
        launch(uses_lock, 2)


def test_launch_needs_a_function():
    with pytest.raises(TypeError, match="needs a function"):
        launch("ranks.whoami", 2)
