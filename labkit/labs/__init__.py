"""The labs: one module per topic a notebook drives (its runs, its tables, its predictions beside
the measurements). Import the one you need: ``from labkit.labs import memory``.

- ``equivalence``: every strategy against single-device training (``labkit.check``)
- ``comm``: collective bandwidth, the alpha-beta fit, DDP's knobs (notebook 06)
- ``compute_profile``: per-layer compute measured on ranks, the step predictor's input
- ``pipeline_bubble``: pipeline schedules as events, the bubble measured and predicted (03)
- ``load_balance``, ``uneven``, ``cost_split``: stragglers, shares, uneven inputs (07)
- ``memory``: memory per rank by category beside the calculator (08)
- ``sync_async``: DDP, local SGD, DiLoCo, a parameter server and Hogwild to one loss (09)
- ``elastic``: torchrun agents joining, leaving and restarting (10)
- ``sched/``: cluster scheduling, simulated and replayed with real runs (11)

Labs import the layers below them, never each other (``pyproject.toml``'s contract).
"""
