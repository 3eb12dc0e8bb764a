"""osdp-fx: a torch.fx graph compiler for data-parallel training with per-operator sharding."""

from __future__ import annotations

from .api import OSDPModule, compile_osdp
from .checkpoint import load_checkpoint, save_checkpoint
from .clip import clip_grad_norm_
from .devices import Devices
from .errors import (CaptureError, CheckpointError, InputError, OSDPError, PlanError,
                     PlanMismatchError)
from .plan import Plan
from .precision import MixedPrecision

__all__ = ["compile_osdp", "clip_grad_norm_", "Devices", "MixedPrecision", "OSDPModule", "Plan",
           "load_checkpoint", "save_checkpoint", "OSDPError", "CaptureError", "CheckpointError",
           "InputError", "PlanError", "PlanMismatchError"]
__version__ = "0.1.0"
