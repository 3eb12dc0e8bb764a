"""What a plan is: ``Plan`` and its JSON, what ``plan=`` asked for (``request``), and the views a
user reads (the printed table, the folded view of repeated blocks, the memory plot).

Imports ``core`` only.
"""

from __future__ import annotations

from .plan import ParamPlan, Plan, Prediction, SplitPlan

__all__ = ["ParamPlan", "Plan", "Prediction", "SplitPlan"]
