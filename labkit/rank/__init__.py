"""What runs inside a rank process, beside the strategies: the shared training loops (``loop``,
``stages``), what watches them through one interface (``watch``: the step probe, the memory
meter, the profiler, checkpoints, the record builder ``recorder``), what a strategy composes
into them (load balancing and stragglers, Join), and DDP's knobs, mixed precision, synchronised
batch norm and layer timing.

Nothing here reads records into tables or draws figures: that is the caller's side
(``labkit.records``, ``labkit.plots``), which rank processes never import.
"""
