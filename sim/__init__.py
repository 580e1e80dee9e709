"""A vLLM-compatible model-server simulator (`python -m sim`). The EPP never imports it."""
