"""Imported once by the forkserver that forks every test rank (``harness.world``).

It imports what the ranks' cases use, so that a forked rank finds them loaded: torch and
torch._dynamo / torch.export (captures, the profiler), transformers' GPT-2 and Llama and peft
(the Hugging Face cases), osdp_fx and the case modules, and has the ranks' cases share captures
of the same Hugging Face model (``harness.shared_captures``). Then it moves every object alive into
the collector's permanent generation (``gc.freeze``), which the forks inherit. Nothing here runs
a torch operator or starts a thread, so forking this process is safe.
"""

from __future__ import annotations

import importlib

from . import shared_captures
from .world import freeze_imported_objects

OPTIONAL = (
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "peft",
)
CASES = (
    "cases", "models", "autotune_cases", "checkpoint_cases", "clip_cases", "compile_cases",
    "fault_cases", "hierarchy_cases", "memory_cases", "meta_cases", "no_sync_cases",
    "property_cases", "recompute_cases", "reducer_cases", "shape_cases", "split_cases",
    "two_models_cases", "zoo_cases",
)

for _name in OPTIONAL:
    try:
        importlib.import_module(_name)
    except Exception:  # not installed: the cases that need it skip or fail on their own
        pass
for _name in CASES:
    try:
        importlib.import_module(f"{__package__}.{_name}")
    except Exception:  # a case module being edited or removed: its ranks import it later
        pass
shared_captures.install()  # cases of a rank share the captures of a Hugging Face model
freeze_imported_objects()
