"""Hugging Face weights in: :func:`load_hf_weights` fills a compiled model from a checkpoint
directory of safetensors files, each rank reading only the rows it holds.

The way in for a model too large for one rank: build it on the meta device, compile it (its
parameters become this rank's shards, initialised by ``init_fn``, see ``materialize.py``), then
load the pretrained values::

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    compiled = compile_osdp(model, inputs, init_fn=model._init_weights)
    load_hf_weights(checkpoint_dir, compiled)

The directory is what ``save_pretrained`` writes: ``model.safetensors``, or
``model-0000i-of-0000n.safetensors`` shards with their index. It is read with
``torch.distributed.checkpoint``'s ``HuggingFaceStorageReader``: every parameter is a target
laid out as this rank holds it (a sharded one is a ``Shard(0)`` DTensor whose local tensor is a
view of the shard, as in ``checkpoint.py``), so DCP reads each target's rows with safetensors'
``get_slice`` and copies them in place, casting from the file's dtype to the parameter's. No rank
ever holds a whole file or a whole sharded weight, except a weight split into parts
(``passes/split_linear.py``), which is read as ``torch.chunk``'s row chunk, gathered whole and
cut into this model's parts and shards, one weight at a time.

Names: a checkpoint's keys are the names of the Hugging Face model (``model.layers.0.mlp.
up_proj.weight``), and the compiled module may hold that model under a prefix (a wrapper's
``model.``, peft's ``base_model.model.``) and peft's ``base_layer`` inside each adapted layer.
Each of the compiled module's names is read as the key left after removing ``.base_layer`` and
one prefix, the same for every name: the prefix under which most names are keys. A tied weight
is read from whichever of its names the checkpoint holds. Buffers the checkpoint holds are read
whole on every rank.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter

import torch

from ..errors import CheckpointError, InputError
from ..module import OSDPModule
from .checkpoint import _layouts, _put_whole, _whole_layout, read_agreed

_PEFT_BASE_LAYER = ".base_layer"
_FIX = ("Call load_hf_weights on every rank with the same directory.")


@dataclasses.dataclass(frozen=True)
class HFLoadResult:
    """What :func:`load_hf_weights` did not pair (as ``nn.Module.load_state_dict`` reports)."""

    missing_keys: list[str]
    """The compiled module's parameters the checkpoint does not hold (left as they were)."""
    unexpected_keys: list[str]
    """The checkpoint's tensors that no parameter or buffer of the module reads."""


def load_hf_weights(path: str | os.PathLike[str], compiled: OSDPModule, *,
                    strict: bool = True) -> HFLoadResult:
    """Load the safetensors checkpoint directory ``path`` (as ``save_pretrained`` writes it)
    into ``compiled``, each rank reading only its own shards (module docstring).

    ``strict``: raise CheckpointError when a parameter of the module is not in the checkpoint
    or a tensor of the checkpoint is read by nothing (nothing is loaded then); with
    ``strict=False`` those are returned (a LoRA model's adapters are not in its base's
    checkpoint). A tensor whose shape differs from the parameter's is always an error.

    Collective: every rank must call it. Raises CheckpointError on every rank when the
    directory cannot be read or does not fit the model."""
    path = os.fspath(path)
    reading = read_agreed("load_hf_weights", path, compiled, _FIX,
                          lambda: _HFReading(path, compiled, strict))
    return reading.result


def _checkpoint_keys(path: str) -> tuple[object, dict[str, tuple[int, ...]]]:
    """The directory's reader and each tensor's key and shape (read by this rank alone)."""
    if not os.path.isdir(path) or not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise CheckpointError(
            f"no safetensors checkpoint at {path!r}; pass the directory that save_pretrained "
            "wrote (it holds model.safetensors or model-*-of-*.safetensors)")
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageReader
    except ImportError as exc:  # torch < 2.8
        raise InputError("load_hf_weights needs torch>=2.8 (its HuggingFaceStorageReader)"
                         ) from exc
    try:
        reader = HuggingFaceStorageReader(path)
        metadata = reader.read_metadata()
    except ImportError as exc:
        raise InputError("load_hf_weights needs safetensors: pip install 'osdp-fx[hf]'"
                         ) from exc
    shapes = {k: tuple(m.size) for k, m in metadata.state_dict_metadata.items()
              if hasattr(m, "size")}
    return reader, shapes


def _prefix(names: list[str], keys: set[str]) -> str:
    """The prefix (ending with a dot, or empty) under which most ``names`` are ``keys``; the
    shortest among equals."""
    found: Counter[str] = Counter()
    for name in names:
        parts = name.split(".")
        for i in range(len(parts)):
            if ".".join(parts[i:]) in keys:
                found[".".join(parts[:i]) + ("." if i else "")] += 1
    if not found:
        return ""
    best = max(found.values())
    return min((p for p, n in found.items() if n == best), key=len)


def _key(name: str, prefix: str) -> str:
    name = name.replace(_PEFT_BASE_LAYER + ".", ".")
    return name[len(prefix):] if name.startswith(prefix) else name


class _HFReading:
    """The targets ``dcp.load`` fills from the checkpoint, keyed by the checkpoint's names, and
    the split weights to put in place after it (:meth:`finish`)."""

    def __init__(self, path: str, compiled: OSDPModule, strict: bool) -> None:
        self.compiled = compiled
        reader, shapes = _checkpoint_keys(path)
        self.load_options = {"storage_reader": reader}
        table = compiled.param_table
        aliases: dict[str, list[str]] = {}
        for alias, group in table.alias_to_name.items():
            aliases.setdefault(group, []).append(alias)
        buffers = table.buffer_keys
        every = [a for names in aliases.values() for a in names] + buffers
        prefix = _prefix([n.replace(_PEFT_BASE_LAYER + ".", ".") for n in every], set(shapes))
        layouts = _layouts(compiled)
        self.state: dict[str, torch.Tensor] = {}
        self.whole: dict[str, object] = {}
        missing, wrong, used = [], [], set()
        for group, names in aliases.items():
            held = [k for k in dict.fromkeys(_key(n, prefix) for n in names) if k in shapes]
            if not held:
                missing.append(group)
                continue
            key = held[0]
            used.update(held)  # a checkpoint may hold a tied weight under each of its names
            shape = table.full_shape(group)
            if tuple(shapes[key]) != tuple(shape):
                wrong.append(f"{key}: checkpoint {shapes[key]}, model {shape}")
                continue
            parts = table.parts(group)
            if parts == (group,):
                lay = layouts[group]
                self.state[key] = (lay.wrap(lay.local) if shape else
                                   table.local(group).detach().view(()))
            else:
                self.whole[group] = lay = _whole_layout(shape, table.local(parts[0]).detach())
                self.state[key] = lay.wrap(lay.local)
        self.buffers: dict[str, torch.Tensor] = {}
        for name in buffers:
            key = _key(name, prefix)
            if key in shapes:
                used.add(key)
                held = table.buffer(name)
                if tuple(shapes[key]) != tuple(held.shape):
                    wrong.append(f"{key}: checkpoint {shapes[key]}, model {tuple(held.shape)}")
                    continue
                self.buffers[name] = self.state[key] = torch.empty_like(held)
        unexpected = sorted(set(shapes) - used)
        if wrong:
            raise CheckpointError(
                f"the checkpoint at {path!r} holds {len(wrong)} tensors at other shapes than "
                f"this model's ({'; '.join(wrong[:4])}); build the model from the checkpoint's "
                "config.json (AutoConfig.from_pretrained), and load a 4-bit base with "
                "from_pretrained(..., quantization_config=...) instead")
        if strict and (missing or unexpected):
            raise CheckpointError(
                f"the checkpoint at {path!r} does not hold exactly this model's parameters "
                f"(missing: {missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected: "
                f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}); pass strict=False "
                "to load what pairs and keep the rest as initialised (a LoRA model's adapters)")
        self.result = HFLoadResult(missing_keys=missing, unexpected_keys=unexpected)

    def finish(self) -> None:
        """After ``dcp.load``: buffers copied in; each split weight gathered from its chunks
        (collective, in the same order on every rank) and cut into its parts and shards."""
        table = self.compiled.param_table
        with torch.no_grad():
            for name, loaded in self.buffers.items():
                table.buffer(name).copy_(loaded)
            for group, lay in self.whole.items():
                _put_whole(table, group, lay)
