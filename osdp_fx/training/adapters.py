"""Trained adapters out in peft's format: :func:`save_peft_adapters`.

A LoRA fine-tune compiled from a peft model trains its adapters sharded or replicated as the
plan says; what leaves the run is what peft's ``save_pretrained`` writes, so that
``PeftModel.from_pretrained(base, directory)`` loads it in one process:
``adapter_model.safetensors`` (the adapters' full tensors under peft's keys, as
``peft.get_peft_model_state_dict`` names them) and ``adapter_config.json`` (the adapter's
``LoraConfig``). Only the trainable parameters are gathered
(``OSDPModule.full_state_dict(ignore_frozen_params=True)``): no rank ever holds the frozen
base whole.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..errors import InputError
from ..module import OSDPModule
from ..runtime.collectives import WORLD, group_rank


def save_peft_adapters(compiled: OSDPModule, peft_model: nn.Module, directory: str | os.PathLike,
                       *, adapter_name: str = "default") -> None:
    """Write the trained adapters of ``compiled`` to ``directory`` as peft's
    ``peft_model.save_pretrained(directory)`` would (rank 0 writes; collective: every rank
    calls it, and every rank returns once the files are written).

    ``peft_model`` is the peft model the compiled module was built from (a ``PeftModel``, or
    the model ``get_peft_model`` returned), itself or inside the module given to
    ``compile_osdp``: its adapter configuration is saved, and its parameter names locate the
    adapters among the compiled module's. It is not changed."""
    try:
        from peft import get_peft_model_state_dict
    except ImportError as exc:
        raise InputError("save_peft_adapters needs peft: pip install 'osdp-fx[hf]'") from exc
    configs = getattr(peft_model, "peft_config", None)
    if not isinstance(configs, dict) or adapter_name not in configs:
        raise InputError(
            f"save_peft_adapters: {type(peft_model).__name__} has no peft adapter "
            f"{adapter_name!r} (adapters: {sorted(configs) if isinstance(configs, dict) else []});"
            " pass the model get_peft_model returned and the name of its adapter")
    full = compiled.full_state_dict(rank0_only=True, ignore_frozen_params=True)
    if group_rank(WORLD) == 0:
        state = _under_peft_names(full, peft_model)
        adapters = get_peft_model_state_dict(peft_model, state_dict=state,
                                             adapter_name=adapter_name)
        _write(directory, adapters, configs[adapter_name])
    _barrier()


def _under_peft_names(full: dict[str, torch.Tensor], peft_model: nn.Module) -> dict[str, Any]:
    """``full`` (keys of the compiled module) under ``peft_model``'s own parameter names: the
    compiled module may be a wrapper holding the peft model under a prefix."""
    names = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    if not names:
        raise InputError("save_peft_adapters: the peft model has no trainable parameter")
    probe = names[0]
    match = [k for k in full if k == probe or k.endswith("." + probe)]
    if len(match) != 1:
        raise InputError(
            f"save_peft_adapters: the compiled module has no trainable parameter named like the "
            f"peft model's {probe!r}; pass the peft model the compiled module was built from")
    prefix = match[0][:len(match[0]) - len(probe)]
    missing = [n for n in names if prefix + n not in full]
    if missing:
        raise InputError(
            f"save_peft_adapters: the compiled module lacks the peft model's trainable "
            f"parameters {missing[:3]}; pass the peft model the compiled module was built from")
    return {n: full[prefix + n].detach().cpu().contiguous() for n in names}


def _write(directory: str | os.PathLike, adapters: dict[str, torch.Tensor], config: Any) -> None:
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    save_file(adapters, os.path.join(directory, "adapter_model.safetensors"),
              metadata={"format": "pt"})
    inference_mode = config.inference_mode
    config.inference_mode = True  # as peft's save_pretrained writes it
    try:
        config.save_pretrained(str(directory))
    finally:
        config.inference_mode = inference_mode


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
