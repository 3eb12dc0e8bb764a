"""The base layer: the vocabulary every other layer shares.

Owns the strategies and their traits, shard arithmetic and split records (``layout``), bucketing
rules, mixed precision, node metadata, recompute regions, how a call maps to the graph's inputs
(``io_spec``), the hardware record (``devices``) and its presets, and progress reporting.
Imports nothing of osdp_fx but ``errors`` and ``units``.
"""
