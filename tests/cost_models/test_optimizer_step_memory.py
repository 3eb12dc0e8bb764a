"""The optimizer step's peak, in one process: what a storage tracker counts while AdamW steps
a model whose peak is its first ``optimizer.step()`` (large parameters, a small batch), with
the model's output held through the step as a training loop holds it."""

from __future__ import annotations

import torch
from harness.memory_cases import earlier_storages
from torch import nn

from osdp_fx import compile_osdp
from osdp_fx.runtime.storage_tracker import StorageTracker


class Wide(nn.Module):
    """Two large linears with their biases; returns the loss and the output, as a Hugging Face
    model returns its loss and logits."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(128, 512)
        self.down = nn.Linear(512, 128)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.down(torch.relu(self.up(x)))
        return y.square().mean(), y


def test_first_adamw_step_is_predicted_from_above_within_a_parameter() -> None:
    """At ``down.weight``'s update torch's single-tensor AdamW holds its ``sqrt`` and division
    results and still the division result of the parameter before it (``up.bias``), and the
    caller holds the output: a model counting only 2x the largest parameter and dropping the
    outputs after backward predicts less than the tracker measures."""
    torch.manual_seed(0)
    earlier = earlier_storages([])
    compiled = compile_osdp(Wide(), (torch.randn(4, 128),), plan="replicate", optimizer="adamw")
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    x = torch.randn(4, 128)
    largest = 512 * 128 * 4
    peaks = []
    for _ in range(2):
        tracker = StorageTracker()
        with tracker:
            loss, out = compiled(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            del loss, out
        # what the process held before the model (earlier tests' tensors) is not the step's
        held = {id(s): s.nbytes() for s in (ref() for ref in earlier) if s is not None}
        peaks.append(tracker.peak_bytes - sum(held.values()))
    pr = compiled.plan.prediction
    for measured, predicted in zip(peaks, (pr.first_step_peak_bytes, pr.peak_memory_bytes)):
        assert predicted - largest <= measured <= predicted, (peaks, predicted)
