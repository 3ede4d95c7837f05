"""Inference: one base model in memory with the LoRA adapters of ember runs swapped onto it; and
`ember export`, a completed run's weights for other engines (hf, peft, gguf)."""
