"""The planner: from a captured graph to a ``Plan``.

``make`` composes it (:func:`plan_model`, the one planning entry): profile (``analysis``), predict (the cost models), search (``search``,
``exhaustive``, ``local_search``, ``search_margin``, ``schedule_search``, ``solver``), and, when
asked, measure candidate plans (``autotune``); ``detect`` measures the hardware into a
``Devices``. Imports ``core``, ``plan``, ``cost_models``, ``runtime`` and ``passes``.
"""

from __future__ import annotations

from .make import Planned, SearchOptions, plan_model

__all__ = ["Planned", "SearchOptions", "plan_model"]
