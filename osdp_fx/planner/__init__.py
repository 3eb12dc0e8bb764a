"""The planner: from a captured graph to a ``Plan``.

``make`` composes it: profile (``analysis``), predict (the cost models), search (``search``,
``exhaustive``, ``local_search``, ``search_margin``, ``schedule_search``, ``solver``), and, when
asked, measure candidate plans (``autotune``); ``detect`` measures the hardware into a
``Devices``. Imports ``core``, ``plan``, ``cost_models``, ``runtime`` and ``passes``.
"""

from __future__ import annotations

from .make import make_plan

__all__ = ["make_plan"]
