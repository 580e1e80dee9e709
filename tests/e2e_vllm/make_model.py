"""Write a tiny random-weight Qwen2 model that vLLM can serve: the real-vLLM tier
needs an engine whose tokenizer and chat template are a real model's (so the EPP's
tokenization is checked against vLLM's own), but no weights can be downloaded, and
routing does not care what the model says.

Run by the vLLM virtualenv's interpreter (it has torch and safetensors):

    .venv-vllm/bin/python tests/e2e_vllm/make_model.py OUT_DIR TOKENIZER_DIR

The weights come from a fixed seed, so two runs write the same files. The shapes
are the Qwen2 architecture's, shrunk (2 layers, hidden size 128) except the
vocabulary, which must be the tokenizer's.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

SEED = 20_251_126
LAYERS = 2
HIDDEN = 128
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 256
# Qwen2.5's embedding rows (the tokenizer's 151,665 ids padded as the real models are).
VOCAB = 151_936
MAX_POSITIONS = 4096
INIT_STD = 0.02
BOS_ID = 151_643  # <|endoftext|>
EOS_ID = 151_645  # <|im_end|>: where a chat turn ends

CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "hidden_act": "silu",
    "max_position_embeddings": MAX_POSITIONS,
    "max_window_layers": LAYERS,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "sliding_window": None,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": VOCAB,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "attention_dropout": 0.0,
    "initializer_range": INIT_STD,
    "use_cache": True,
}


def weights() -> dict[str, torch.Tensor]:
    """Every tensor Qwen2ForCausalLM loads, normal(0, 0.02) matrices, unit norms,
    zero biases, in a fixed order from one seeded generator."""
    generator = torch.Generator().manual_seed(SEED)
    head_dim = HIDDEN // HEADS

    def matrix(rows: int, cols: int) -> torch.Tensor:
        values = torch.randn(rows, cols, generator=generator) * INIT_STD
        return values.to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.bfloat16)

    out = {"model.embed_tokens.weight": matrix(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ones(HIDDEN)
        out[p + "post_attention_layernorm.weight"] = ones(HIDDEN)
        out[p + "self_attn.q_proj.weight"] = matrix(HEADS * head_dim, HIDDEN)
        out[p + "self_attn.q_proj.bias"] = zeros(HEADS * head_dim)
        out[p + "self_attn.k_proj.weight"] = matrix(KV_HEADS * head_dim, HIDDEN)
        out[p + "self_attn.k_proj.bias"] = zeros(KV_HEADS * head_dim)
        out[p + "self_attn.v_proj.weight"] = matrix(KV_HEADS * head_dim, HIDDEN)
        out[p + "self_attn.v_proj.bias"] = zeros(KV_HEADS * head_dim)
        out[p + "self_attn.o_proj.weight"] = matrix(HIDDEN, HEADS * head_dim)
        out[p + "mlp.gate_proj.weight"] = matrix(INTERMEDIATE, HIDDEN)
        out[p + "mlp.up_proj.weight"] = matrix(INTERMEDIATE, HIDDEN)
        out[p + "mlp.down_proj.weight"] = matrix(HIDDEN, INTERMEDIATE)
    out["model.norm.weight"] = ones(HIDDEN)
    return out


def write(out_dir: Path, tokenizer_dir: Path) -> None:
    # Written beside the target and renamed at the end: an interrupted run leaves
    # no half model that a later run would take as done.
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, partial / name)
    (partial / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    generation = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, BOS_ID], "do_sample": False}
    (partial / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(weights(), str(partial / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out_dir, ignore_errors=True)
    partial.rename(out_dir)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    write(Path(argv[0]), Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
