"""Short full passes of the garbage collector in serving processes.

A worker holds ~240k objects the collector tracks once it has started (torch,
transformers, gRPC, the model's modules), and a full pass (generation 2) walks them all
while holding the GIL: ~110 ms here, a stall of every thread, the engine's included.
Full passes come whenever the objects that survived since the last one reach a quarter of
those, which a busy worker reaches every few hundred requests.

``freeze_startup_heap``, called once a process is ready to serve, moves every object
alive then to the collector's permanent generation (``gc.freeze``), which no pass
walks; what is created after is collected as before. vLLM does the same after its engine
starts. The cost: a frozen object that later dies in a reference cycle is never freed.
Startup objects live as long as the process, except LoRA adapters unloaded at run time,
which are freed by reference counting (they hold no cycles).

``benchmarks/gc_pauses.py`` measures it (``benchmarks/results/gc_pauses_cpu.md``).
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once, then freeze everything alive; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%d startup objects frozen out of the garbage collector's passes", frozen)
    return frozen
