"""The textbook experiments, run for real on kvlab's engine and caches.

    invariance   a causal model's earlier outputs do not change when a token is appended
                 (so their K/V can be cached); without the mask they do, and a cache goes stale
    counts       (query, key) scores and K/V projections counted while the engine generates,
                 with and without a cache, against Σk² and n(n+1)/2
    gqa          the seed's record table: a byte-level GPT with n_kv_head 8/4/2/1, trained the
                 same short way on Shakespeare; cache bytes, ratios, tokens/s, validation loss
    speed        tokens/s with and without the cache (lab GPT and SmolLM2), against the ratio
                 the operation counts predict
    report       `kvlab lab all`: every experiment, one progress bar, a Markdown report
"""
