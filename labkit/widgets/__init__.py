"""ipywidgets panels: one shared background-run mechanism (``base.BackgroundRun``) and one
module per lab's panel."""

from .balance_panel import BalancePanel, balance_panel
from .base import BackgroundRun, mime_output
from .comm_panel import CommPanel, WhatIfPanel, comm_panel
from .cp_panel import CPPanel, cp_panel
from .elastic_panel import ElasticPanel, elastic_panel
from .fit_panel import FitPanel, fit_panel
from .layout_panel import AdvisorPanel, LayoutPanel, advisor_panel, layout_panel
from .memory_panel import MemoryPanel, memory_panel
from .moe_panel import MoEPanel, moe_panel
from .pipeline_panel import PipelinePanel, last_step_events, pipeline_panel
from .run_panel import RunPanel, run_panel, world_sizes_upto
from .sched_panel import SchedPanel, sched_panel
from .sync_panel import SyncPanel, sync_panel

__all__ = [
    "BackgroundRun",
    "mime_output",
    "RunPanel",
    "run_panel",
    "world_sizes_upto",
    "PipelinePanel",
    "pipeline_panel",
    "last_step_events",
    "CommPanel",
    "WhatIfPanel",
    "comm_panel",
    "BalancePanel",
    "balance_panel",
    "MemoryPanel",
    "memory_panel",
    "SyncPanel",
    "sync_panel",
    "ElasticPanel",
    "elastic_panel",
    "SchedPanel",
    "sched_panel",
    "MoEPanel",
    "moe_panel",
    "LayoutPanel",
    "layout_panel",
    "AdvisorPanel",
    "advisor_panel",
    "CPPanel",
    "cp_panel",
    "FitPanel",
    "fit_panel",
]
