"""What a training loop uses around a compiled module: checkpoints, meta-device
materialisation, gradient clipping. Imports every layer below the front door (``module``)."""
