"""The cost models: pure functions of numbers (time, bytes, memory timeline) over a graph's
facts and a ``Devices``. Imports ``core`` and ``plan`` only."""
