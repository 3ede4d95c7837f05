"""ember: recoverable, reproducible, accountable fine-tuning on machines you control."""

__version__ = "0.1.0"
