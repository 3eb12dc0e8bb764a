"""Errors a user can cause. Each message says what was wrong and what to do about it."""

from __future__ import annotations


class OSDPError(Exception):
    """Base class of every error osdp-fx raises for a problem in the user's input."""


class CaptureError(OSDPError):
    """The model could not be captured as a graph (neither torch.fx nor torch.export)."""


class PlanError(OSDPError):
    """A plan (strategy name, Plan object or plan file) is invalid for this model or world."""


class PlanMismatchError(PlanError):
    """Ranks compiled different plans; running them would hang or corrupt training."""


class InputError(OSDPError):
    """The model, its example inputs or an option passed to compile_osdp is invalid."""


class CheckpointError(OSDPError):
    """A checkpoint could not be saved or does not fit the model or optimizer it is loaded into."""


class CollectiveError(OSDPError):
    """A collective every rank must call did not complete: this rank called it and the others
    did not join it within the process group's timeout (a call made on one rank alone, or
    another rank failed or is far behind)."""
