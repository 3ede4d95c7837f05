"""The data pipeline: data files -> records (sources) -> token ids and the tokens the loss learns
(formats, chat, truncation) -> a cached token store (tokenize) -> micro-batches in a seeded order
(loader). Torch-free except the loader; below training, which it never imports."""
