"""The tokenizer part of the GGUF export (docs/engines.md, "What the export writes").

llama.cpp reads a tokenizer from GGUF metadata only: ``tokenizer.ggml.model`` picks the algorithm (``gpt2`` for
byte-level BPE, ``llama`` for SentencePiece), ``tokenizer.ggml.pre`` names the pre-tokenizer regex for BPE, and the
token list, token types, merges (BPE) or scores (SentencePiece), special token ids, the add-BOS/EOS flags and the
chat template complete it. Everything here is read from the tokenizer files ``convert`` copied into the converted
folder, so llama.cpp tokenises as transformers does with that folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import gguf
from sentencepiece import SentencePieceProcessor

from mha2mla import UserError
from mha2mla.io.loader import load_tokenizer
from mha2mla.io.model_folder import SENTENCEPIECE_MODEL, TOKENIZER_JSON

# The split regexes of the byte-level BPE tokenizers of the supported families, as their tokenizer.json
# files spell them, and the llama.cpp pre-tokenizer name that applies the same split (docs/engines.md).
_DIGITS_1_3 = r"\p{N}{1,3}"
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|{digits}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
KNOWN_SPLITS = {
    _SPLIT_PATTERN.replace("{digits}", _DIGITS_1_3): "llama-bpe",  # Llama-3
    _SPLIT_PATTERN.replace("{digits}", r"\p{N}"): "qwen2",  # Qwen2 / Qwen2.5
}
PRE_TOKENIZERS = ("gpt-2", "smollm", "llama-bpe", "qwen2")
# Every tokenizer.ggml.pre name llama.cpp's vocab loader knows (src/llama-vocab.cpp); it reads any other name as
# 'default' with only a log line, which tokenises wrongly, so --pre takes only these.
LLAMA_CPP_PRE_TOKENIZERS = frozenset("""
default llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 deepseek-llm deepseek-coder deepseek-v3
falcon mpt starcoder gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum jina-v1-en
jina-v2-code roberta-bpe refact command-r qwen2 deepseek-r1-qwen kormo stablelm2 olmo dbrx smaug-bpe poro-chat glm4
chatglm-bpe viking jais tekken smollm codeshell bloom gpt3-finnish exaone exaone4 chameleon minerva-7b megrez gpt-4o
llama4 superbpe trillion granite-docling bailingmoe bailingmoe2 llada-moe seed-coder hunyuan hunyuan-dense kimi-k2
grok-2 afmoe minimax-m2
""".split())


def check_pre_tokenizer(name: str | None) -> None:
    """Refuse a --pre that llama.cpp would not recognise (it would tokenise with its default split instead)."""
    if name is not None and name not in LLAMA_CPP_PRE_TOKENIZERS:
        raise UserError(f"--pre {name!r} is not a pre-tokenizer llama.cpp knows; give one of "
                        f"{', '.join(sorted(LLAMA_CPP_PRE_TOKENIZERS))} (the byte-level BPE tokenizers mha2mla "
                        f"converts use {', '.join(PRE_TOKENIZERS)}).")


@dataclass
class Vocab:
    """What the GGUF says about the tokenizer (token lists, in id order, padded to the model's vocab size)."""

    model: str
    tokens: list[str]
    types: list[int]
    pre: str | None = None
    merges: list[str] = field(default_factory=list)
    scores: list[float] | None = None
    hf_tokenizer: object = None  # transformers' tokenizer of the folder, the reference for the special tokens

    def add_to(self, writer: gguf.GGUFWriter, folder: Path) -> None:
        writer.add_tokenizer_model(self.model)
        if self.pre is not None:
            writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        if self.merges:
            writer.add_token_merges(self.merges)
        # special token ids and the chat template, read by the gguf package's own helper; the ids and whether BOS /
        # EOS are added then follow what transformers' tokenizer does with this folder
        special = gguf.SpecialVocab(folder, load_merges=False, n_vocab=len(self.tokens))
        special.special_token_ids.update(tokenizer_special_ids(self.hf_tokenizer))
        special.add_special_token = added_special_tokens(self.hf_tokenizer)
        special.add_to_gguf(writer, quiet=True)


def tokenizer_special_ids(tokenizer) -> dict[str, int]:
    names = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "unk": tokenizer.unk_token_id,
             "pad": tokenizer.pad_token_id}
    return {name: token_id for name, token_id in names.items() if token_id is not None}


def added_special_tokens(tokenizer) -> dict[str, bool]:
    """Whether the tokenizer puts a token before (BOS) or after (EOS) the text."""
    plain = tokenizer("a b", add_special_tokens=False)["input_ids"]
    full = tokenizer("a b")["input_ids"]
    return {"bos": full[:1] != plain[:1], "eos": full[-1:] != plain[-1:]}


def read_vocab(folder: Path, vocab_size: int, pre: str | None = None) -> Vocab:
    """The tokenizer of the converted ``folder``: byte-level BPE from tokenizer.json, else SentencePiece from
    tokenizer.model. ``pre`` overrides the detected BPE pre-tokenizer name."""
    vocab = _read_vocab(folder, vocab_size, pre)
    vocab.hf_tokenizer = load_tokenizer(folder, hint="copy the source model's tokenizer files into it")
    return vocab


def _read_vocab(folder: Path, vocab_size: int, pre: str | None) -> Vocab:
    tokenizer_json = folder / TOKENIZER_JSON
    data = json.loads(tokenizer_json.read_text(encoding="utf-8")) if tokenizer_json.exists() else None
    if data is not None and data.get("model", {}).get("type") == "BPE" and _has_byte_level(data.get("pre_tokenizer")):
        return _bpe_vocab(data, vocab_size, pre or detect_pre_tokenizer(data.get("pre_tokenizer"), folder))
    if (folder / SENTENCEPIECE_MODEL).exists():
        return _sentencepiece_vocab(folder / SENTENCEPIECE_MODEL, data, vocab_size)
    raise UserError(f"{folder} has neither a byte-level BPE tokenizer.json nor a SentencePiece tokenizer.model; "
                    "copy the source model's tokenizer files into it.")


def _has_byte_level(pre_tokenizer: dict | None) -> bool:
    if not pre_tokenizer:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_has_byte_level(item) for item in pre_tokenizer.get("pretokenizers", []))
    return pre_tokenizer.get("type") == "ByteLevel"


def detect_pre_tokenizer(pre_tokenizer: dict, folder: Path) -> str:
    """The llama.cpp pre-tokenizer name that splits text as tokenizer.json's ``pre_tokenizer`` does."""
    steps = pre_tokenizer.get("pretokenizers", []) if pre_tokenizer.get("type") == "Sequence" else [pre_tokenizer]
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"  # GPT-2's own regex inside the byte-level step
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"  # single digits, then the GPT-2 regex
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        name = KNOWN_SPLITS.get(steps[0].get("pattern", {}).get("Regex", ""))
        if name is not None:
            return name
    raise UserError(f"the pre-tokenizer in {folder / 'tokenizer.json'} is not one export-gguf recognises; pass "
                    f"the llama.cpp name that matches it (one of {', '.join(PRE_TOKENIZERS)}, or another) as --pre.")


def _merge_text(merge) -> str:
    return merge if isinstance(merge, str) else " ".join(merge)


def _bpe_vocab(data: dict, vocab_size: int, pre: str) -> Vocab:
    by_id: dict[int, tuple[str, int]] = {
        token_id: (text, gguf.TokenType.NORMAL) for text, token_id in data["model"]["vocab"].items()
    }
    for added in data.get("added_tokens", []):
        kind = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        by_id[added["id"]] = (added["content"], kind)
    tokens, types = _in_id_order(by_id, vocab_size)
    merges = [_merge_text(merge) for merge in data["model"].get("merges", [])]
    if not merges:
        raise UserError("tokenizer.json has no BPE merges, which llama.cpp requires of a BPE tokenizer; "
                        "copy the source model's complete tokenizer files into the folder.")
    return Vocab(model="gpt2", pre=pre, tokens=tokens, types=types, merges=merges)


def _in_id_order(by_id: dict[int, tuple[str, int]], vocab_size: int) -> tuple[list[str], list[int]]:
    """Token texts and types for ids 0..vocab_size-1; ids the tokenizer lacks become unused padding tokens."""
    largest = max(by_id, default=-1)
    if largest >= vocab_size:
        raise UserError(f"the tokenizer has token id {largest} but the model's vocab_size is {vocab_size}; "
                        "the tokenizer files do not belong to this model.")
    tokens, types = [], []
    for token_id in range(vocab_size):
        text, kind = by_id.get(token_id, (f"[PAD{token_id}]", gguf.TokenType.UNUSED))
        tokens.append(text)
        types.append(int(kind))
    return tokens, types


def _sentencepiece_type(processor: SentencePieceProcessor, token_id: int) -> int:
    if processor.is_unknown(token_id):
        return gguf.TokenType.UNKNOWN
    if processor.is_control(token_id):
        return gguf.TokenType.CONTROL
    if processor.is_unused(token_id):
        return gguf.TokenType.UNUSED
    if processor.is_byte(token_id):
        return gguf.TokenType.BYTE
    return gguf.TokenType.NORMAL


def _sentencepiece_vocab(model_file: Path, data: dict | None, vocab_size: int) -> Vocab:
    processor = SentencePieceProcessor(model_file=str(model_file))
    by_id = {i: (processor.id_to_piece(i), _sentencepiece_type(processor, i)) for i in range(processor.vocab_size())}
    scores = {i: processor.get_score(i) for i in by_id}
    for added in (data or {}).get("added_tokens", []):
        if added["id"] not in by_id:  # tokens added on top of the SentencePiece model
            kind = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
            by_id[added["id"]] = (added["content"], kind)
    tokens, types = _in_id_order(by_id, vocab_size)
    return Vocab(model="llama", tokens=tokens, types=types, scores=[scores.get(i, -1000.0) for i in range(vocab_size)])
