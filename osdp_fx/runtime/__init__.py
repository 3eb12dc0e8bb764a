"""What runs in a training step: collectives by group name, the autograd functions the graph
calls, reducers, re-gathers, accumulation, this rank's parameter table, and the storage tracker
that measures what a process holds. Imports ``core`` and ``plan`` only."""
