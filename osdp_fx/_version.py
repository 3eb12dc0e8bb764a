"""The version of osdp-fx (``osdp_fx.__version__``), at the bottom of the layers so that any
module may read it (the plan cache keys plans by it)."""

VERSION = "0.2.0.dev0"
