"""Generation from the latent cache (docs/generate.md): the batched loop, sampling, streamed detokenisation, EOS.

The forward passes are :class:`mha2mla.modeling.model.MLAModel`'s; :class:`MLAEngine` adds the tokenizer and the
EOS ids of the checkpoint folder and runs prefill once, then one absorbed decode step per generated token.

    engine = MLAEngine.from_pretrained("out/smollm2-mla", device="cpu")
    [result] = engine.generate(["The latent cache"], max_new_tokens=32, stream=lambda row, text: print(text, end=""))
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mha2mla import UserError
from mha2mla.compute import MAX_SEED, resolve_compute_dtype, torch_dtype
from mha2mla.devices import resolve_device
from mha2mla.io import loader
from mha2mla.io.model_folder import GENERATION_CONFIG
from mha2mla.modeling.generate_config import utf8_problem
from mha2mla.modeling.model import MLAModel

log = logging.getLogger(__name__)

StreamCallback = Callable[[int, str], None]  # (row, new text)


@dataclass
class Generation:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # "eos" or "length"
    logits: torch.Tensor | None = None  # (len(tokens), V) fp32, when asked for


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """logits (B, V) -> token ids (B,). temperature <= 0 is greedy; top_p keeps the smallest set of most
    probable tokens whose mass reaches top_p."""
    scaled = logits.float() / temperature if temperature > 0 else None
    if scaled is None or not torch.isfinite(scaled).all():  # a temperature so small it overflows: its limit, greedy
        return logits.argmax(dim=-1)
    probs = torch.softmax(scaled, dim=-1)  # (B, V)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)  # the top token always survives
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_sampling(max_new_tokens: int, temperature: float, top_p: float, seed: int | None = None) -> None:
    """The generation settings a sampler can use, or one sentence naming the flag."""
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, not {max_new_tokens}.")
    if not math.isfinite(temperature) or temperature < 0:
        raise UserError(f"--temperature must be a finite number of at least 0 (0 is greedy), not {temperature}.")
    if not 0.0 < top_p <= 1.0:  # also false for nan
        raise UserError(f"--top-p must be in (0, 1], not {top_p}.")
    if seed is not None and not 0 <= seed <= MAX_SEED:  # the range of every command's --seed (mha2mla.compute)
        raise UserError(f"--seed must be a whole number from 0 to {MAX_SEED}, not {seed}.")


class IncrementalDetokenizer:
    """Streams the text of each row as tokens arrive, holding back incomplete multi-byte characters."""

    def __init__(self, tokenizer, rows: int):
        self.tokenizer = tokenizer
        self.emitted = [0] * rows

    def push(self, row: int, tokens: list[int], final: bool = False) -> str:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        new = text[self.emitted[row] :]
        self.emitted[row] = len(text)
        return new


def eos_token_ids(folder: Path, config, tokenizer) -> list[int]:
    """Every EOS id the folder declares: config.json, generation_config.json and the tokenizer's."""
    ids: set[int] = set()

    def add(value):
        if value is None:
            return
        ids.update([value] if isinstance(value, int) else value)

    add(config.eos_token_id)
    generation_config = folder / GENERATION_CONFIG
    if generation_config.exists():
        add(json.loads(generation_config.read_text()).get("eos_token_id"))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return sorted(ids)


def _sampling_generator(temperature: float, seed: int | None, device: torch.device) -> torch.Generator | None:
    """A generator of its own (torch's global one is never touched): seeded, or random when seed is None."""
    if temperature <= 0:
        return None
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


class MLAEngine:
    """An :class:`MLAModel` with its tokenizer and EOS ids: batched, ragged generation from the latent cache."""

    def __init__(self, model: MLAModel, tokenizer=None, eos_token_ids: Sequence[int] = ()):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted({int(t) for t in eos_token_ids})

    @property
    def compute_dtype(self) -> str:
        """The resolved compute dtype, ``float32`` or ``bfloat16``: weights, activations and cache of the decode."""
        return str(self.model.dtype).removeprefix("torch.")

    @classmethod
    def from_pretrained(cls, folder: str | Path, device: str | torch.device = "cpu", compute_dtype: str = "auto",
                        load_tokenizer: bool = True, decode_attention: str = "auto") -> MLAEngine:
        """Load a converted checkpoint folder: the model, the tokenizer when the folder has one, and the EOS ids.

        ``compute_dtype`` (auto, float32, bfloat16) is decided here, once, by
        :func:`mha2mla.compute.resolve_compute_dtype` for the device: it is the dtype of the weights, the
        activations and the latent cache (logits are float32 either way); see :meth:`MLAModel.from_pretrained`
        for ``decode_attention``."""
        folder = Path(folder)
        if not isinstance(device, torch.device):
            device = resolve_device(device)
        resolved = resolve_compute_dtype(compute_dtype, str(device))
        log.debug("decoding in %s (compute dtype %s on %s)", resolved, compute_dtype, device)
        model = MLAModel.from_pretrained(folder, device=device, dtype=torch_dtype(resolved),
                                         decode_attention=decode_attention)
        tokenizer = None
        if load_tokenizer:
            try:
                tokenizer = loader.load_tokenizer(folder)
            except UserError:  # a folder without tokenizer files: token ids only
                tokenizer = None
        return cls(model, tokenizer, eos_token_ids(folder, model.config, tokenizer))

    def cap_new_tokens(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """``max_new_tokens`` cut to what the context (``max_position_embeddings``) leaves after the longest prompt,
        said in one line; a prompt that fills the context is refused."""
        context = getattr(self.model.config, "max_position_embeddings", None)
        if context is None or prompt_tokens + max_new_tokens <= context:
            return max_new_tokens
        if prompt_tokens >= context:
            raise UserError(f"the prompt has {prompt_tokens} tokens but the model's context holds {context}; "
                            "give a shorter prompt.")
        log.warning("--max-new-tokens %d capped at %d: the context holds %d tokens and the longest prompt has %d.",
                    max_new_tokens, context - prompt_tokens, context, prompt_tokens)
        return context - prompt_tokens

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise UserError("the model folder has no tokenizer; pass token ids instead of text.")
            problem = utf8_problem(prompt)  # the tokenizer raises a TypeError on text it cannot encode
            if problem is not None:
                raise UserError(f"the prompt {problem}.")
            return list(self.tokenizer(prompt)["input_ids"])
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stream: StreamCallback | None = None,
        eos_token_ids: Sequence[int] | None = None,
        return_logits: bool = False,
    ) -> list[Generation]:
        """Generate up to ``max_new_tokens`` for every prompt (text or token ids), batched with ragged lengths.

        Greedy when temperature is 0, else sampling with temperature and top-p from a generator seeded with
        ``seed``. A row stops at its first EOS token (kept in ``tokens``, not in ``text``). ``stream(row, text)``
        receives each row's new text as it is produced."""
        if not prompts:
            raise UserError("give at least one prompt.")
        check_sampling(max_new_tokens, temperature, top_p, seed)
        encoded = [self.encode(p) for p in prompts]
        max_new_tokens = self.cap_new_tokens(max(len(ids) for ids in encoded), max_new_tokens)
        results = [Generation(prompt_tokens=ids) for ids in encoded]
        eos = set(self.eos_token_ids if eos_token_ids is None else eos_token_ids)
        generator = _sampling_generator(temperature, seed, self.model.device)
        cache = self.model.new_cache(len(encoded), max(len(ids) for ids in encoded) + max_new_tokens)
        detok = IncrementalDetokenizer(self.tokenizer, len(encoded)) if self.tokenizer is not None and stream else None
        step_logits: list[list[torch.Tensor]] = [[] for _ in encoded]
        finished = [False] * len(encoded)

        logits = self.model.prefill(cache, encoded)
        for step in range(max_new_tokens):
            next_tokens = sample_next(logits, temperature, top_p, generator)  # (B,)
            last_step = step == max_new_tokens - 1
            for row, token in enumerate(next_tokens.tolist()):
                if finished[row]:
                    continue
                results[row].tokens.append(token)
                if return_logits:
                    step_logits[row].append(logits[row].cpu())
                if token in eos:
                    finished[row] = True
                    results[row].finish_reason = "eos"
                if detok is not None:
                    piece = detok.push(row, results[row].tokens, final=finished[row] or last_step)
                    if piece:
                        stream(row, piece)
            if all(finished) or last_step:
                break
            logits = self.model.decode(cache, next_tokens)
        for row, result in enumerate(results):
            if self.tokenizer is not None:
                result.text = self.tokenizer.decode(result.tokens, skip_special_tokens=True)
            if return_logits:
                result.logits = torch.stack(step_logits[row])
        return results


__all__ = ["Generation", "IncrementalDetokenizer", "MLAEngine", "StreamCallback", "eos_token_ids", "sample_next"]
