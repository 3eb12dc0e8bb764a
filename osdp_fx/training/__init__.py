"""What a training loop uses around a compiled module: checkpoints, meta-device
materialisation, gradient clipping, peft adapters out. Imports every layer below the front door (``module``)."""
