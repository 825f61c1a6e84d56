"""The runnable decoder: config, weights, tokenizer, forward pass."""
