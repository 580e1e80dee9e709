"""Tokenizing prompts exactly as the engine will, cheaply enough for the pick path.

- `chat_template`: chat templates rendered the way vLLM renders them;
- `tokenizer`: a model's tokenizer with a per-piece cache and off-loop encoding;
- `hub`: tokenizers fetched from the Hugging Face Hub at start-up;
- `models`: which tokenizer a request's model uses (LoRA adapters included);
- `prompts`: from a parsed request to its prompt's token ids.
"""
