"""The sources benchmarks/scale.py converts (no suite of its own): the layer widths of Llama-2-7B, Llama-3-8B,
Mistral-7B, Qwen2.5-7B and Llama-3-70B (SHAPES), built with transformers' own config and model classes, random
weights and a byte-level BPE trained on the bundled calibration sample.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# name -> (transformers model_type, config fields, full depth). head_dim is hidden / heads (128 for all five).
SHAPES: dict[str, tuple[str, dict, int]] = {
    "llama2-7b": ("llama", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                                intermediate_size=11008, rope_theta=10000.0), 32),
    "llama3-8b": ("llama", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                intermediate_size=14336, rope_theta=500000.0), 32),
    "mistral-7b": ("mistral", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                   intermediate_size=14336, rope_theta=1000000.0, sliding_window=None), 32),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                                 intermediate_size=18944, rope_theta=1000000.0), 28),  # q/k/v biases: Qwen2's own
    "llama3-70b": ("llama", dict(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                                 intermediate_size=28672, rope_theta=500000.0), 80),
}


def build_tokenizer(vocab: int):
    """A byte-level BPE of ``vocab`` tokens trained on the bundled calibration sample (the text calibration reads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from mha2mla.convert.calibration.data import bundled_sample_path

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([bundled_sample_path().read_text(encoding="utf-8")], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def build_source(name: str, layers: int, vocab: int, dtype: torch.dtype, folder: Path) -> Path:
    """The random-weight source of shape ``name`` with ``layers`` layers (reused when already built)."""
    marker = folder / "scale_source.json"
    description = {"shape": name, "layers": layers, "vocab": vocab, "dtype": str(dtype)}
    if marker.is_file() and json.loads(marker.read_text()) == description:
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields, _ = SHAPES[name]
    fields = dict(fields)
    config = AutoConfig.for_model(
        model_type, num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=False,
        head_dim=fields["hidden_size"] // fields["num_attention_heads"], bos_token_id=0, eos_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": fields.pop("rope_theta")}, **fields,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(".bias"):  # zero at initialisation; real checkpoints' are not
                param.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    build_tokenizer(vocab).save_pretrained(folder)
    marker.write_text(json.dumps(description) + "\n")
    del model
    return folder


def main(argv: list[str] | None = None) -> int:
    """No suite: ``--help`` says what the module holds, anything else where to measure."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    parser.error("no suite of its own: run python benchmarks/scale.py")
    return 2


if __name__ == "__main__":
    sys.exit(main())
