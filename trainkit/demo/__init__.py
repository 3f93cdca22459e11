"""The embedded default run: TinyGPT (gpt.py) on a synthetic order-2 Markov corpus (markov.py)."""
