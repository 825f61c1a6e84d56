"""Quality of a KV cache: perplexity, agreement with the dense cache, passkey retrieval."""
