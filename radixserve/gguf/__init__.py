"""GGUF support: read hyperparameters, tensors (dequantized) and tokenizer metadata, and convert to a Hugging Face folder."""
