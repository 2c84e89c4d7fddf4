"""Model files, read without weights: geometry (config), config.json, RoPE, tokenizer and chat template.

Router and engine load the model from here (source.py), so they agree on its name (which enters the
block-key namespace), its vocabulary and how text becomes token ids. Nothing here imports torch:
the router imports this wing. Knows nothing of requests, pools or processes.
"""
