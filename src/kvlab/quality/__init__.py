"""How a KV cache changes a model's predictions on text: the corpus windows, perplexity, KL and top-1 agreement
against the dense cache, and the +alloc / +halloc recipes calibrated from them (below every command that uses
them: the eval suite, the runtimes and the serving engine)."""
