"""RunConfigs that the tests/unit and the tests/ranks half of a test file both start from."""

from __future__ import annotations

from labkit import RunConfig

# ddp on 2 ranks: 3 steps (1 of warm-up) of a 2-layer, 64-wide MLP on 256 samples (test_memory)
SMALL_DDP = RunConfig(
    strategy="ddp",
    world_size=2,
    steps=3,
    warmup=1,
    global_batch=32,
    width=64,
    depth=2,
    dataset_size=256,
)

# the same 3 layers deep, with 120 s for a launch (test_factories)
SMALL_DDP_3_LAYERS = SMALL_DDP.replace(depth=3, timeout_s=120)

# the sync/async lab's: 2 ranks, 6 steps and no warm-up of a 1-layer, 32-wide MLP (test_sync_async)
SYNC_ASYNC_BASE = RunConfig(
    world_size=2,
    steps=6,
    warmup=0,
    global_batch=32,
    width=32,
    depth=1,
    dataset_size=512,
    timeout_s=60,
)
