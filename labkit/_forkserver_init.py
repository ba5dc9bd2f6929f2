"""Imported last by the forkserver's preload (never by user code): move everything imported so
far (torch's modules, ~10^5 objects) out of the garbage collector's reach. Each rank forked
from the server inherits the frozen heap, so its collections scan only its own objects and
its ``gc.collect()`` at teardown stays cheap.

No ``gc.collect()`` first: right after these imports it finds nothing to free, and it would
sit on the first launch's critical path (the measurements: benchmarks/README.md, "Behind the code").
The server preloaded with collection off (``labkit._prewarm``); ranks collect as usual."""

import gc

gc.freeze()
gc.enable()
