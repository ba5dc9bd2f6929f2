"""What runs inside a rank process, beside the strategies: the shared training loops, the probes
that time each step, and the pieces a loop plugs in (load balancing, memory counting, Join,
mixed precision, synchronised batch norm, checkpoint I/O, layer timing).

Nothing here reads records into tables or draws figures: that is the caller's side
(``labkit.records``, ``labkit.plots``), which rank processes never import.
"""
