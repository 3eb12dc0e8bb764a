"""The graph passes: capture, and each rewrite or analysis of the captured graph, run in
their declared order by ``manager``. Imports ``core``, ``plan``, ``cost_models`` and ``runtime``."""
