"""The graph passes: capture, and each rewrite or analysis of the captured graph, run in
their declared order by ``pipeline``. Imports ``core``, ``plan``, ``cost_models`` and ``runtime``."""
