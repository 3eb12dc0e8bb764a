"""osdp-fx: a torch.fx graph compiler for data-parallel training with per-operator sharding."""

from __future__ import annotations

import torch as _torch

from ._version import VERSION, torch_too_old
from .errors import InputError as _InputError

if (_too_old := torch_too_old(_torch.__version__)) is not None:
    raise _InputError(_too_old)

from .api import compile_osdp  # noqa: E402  (the checks above come first)
from .core.devices import Devices
from .core.precision import MixedPrecision
from .errors import (
                     CaptureError,
                     CheckpointError,
                     CollectiveError,
                     InputError,
                     OSDPError,
                     PlanError,
                     PlanMismatchError,
)
from .module import OSDPModule
from .plan.plan import Plan
from .planner.detect import detect_devices
from .training.adapters import save_peft_adapters
from .training.checkpoint import load_checkpoint, save_checkpoint
from .training.clip import clip_grad_norm_
from .training.hf_weights import load_hf_weights

__all__ = ["compile_osdp", "clip_grad_norm_", "detect_devices", "Devices", "MixedPrecision", "OSDPModule", "Plan",
           "load_checkpoint", "load_hf_weights", "save_checkpoint", "save_peft_adapters", "OSDPError", "CaptureError", "CheckpointError",
           "CollectiveError", "InputError", "PlanError", "PlanMismatchError"]
__version__ = VERSION
