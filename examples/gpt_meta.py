"""A model factory for ``python -m osdp_fx plan`` (used by plan_cluster.sh): the TinyGPT of
train_gpt.py at about 0.3 B parameters, built on the meta device so that it is planned without
allocating or running it.

A factory returns ``(model, example_inputs)``: the inputs are one rank's batch of one step.
The parameter names and shapes must be those of the model you will train with the plan, so this
builds exactly what

    train_gpt.py --vocab 50257 --dim 2048 --depth 4 --heads 16 --max-len 1024 --batch-size 4

builds.
"""

from __future__ import annotations

import torch

from osdp_fx.examples import TinyGPT


def gpt_300m():
    """4 layers, hidden 2048, GPT-2's vocabulary, sequences of 1024 tokens, 4 per rank."""
    with torch.device("meta"):   # shapes only: no memory, no values
        model = TinyGPT(vocab=50257, dim=2048, depth=4, heads=16, max_seq=1024)
    return model, (torch.randint(0, 50257, (4, 1024), device="meta"),)
