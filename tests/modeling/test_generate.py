"""Latent-cache generation (mha2mla.modeling.model / .generate) against transformers' DeepseekV3 on tiny random models."""

from __future__ import annotations

import sys

import pytest
import torch
from common import randomize_weights, run_cli, tiny_deepseek_config, tiny_tokenizer
from transformers import AutoModelForCausalLM, DynamicCache

from mha2mla import UserError
from mha2mla.modeling.absorbed import write_absorbed
from mha2mla.modeling.generate import MLAEngine, sample_next
from mha2mla.modeling.rmsnorm import rms_norm

CONFIGS = {
    "plain": {},
    "plain-tied": {"tie_word_embeddings": True},
    "exact-like": {"q_lora_rank": 12, "attention_bias": True},
}
PROMPTS = [[5, 17, 3, 99, 42, 7, 250, 11, 64], [9, 8], [120, 33, 200, 1, 77]]


def _save_random_mla(folder, seed: int = 0, with_absorbed: bool = True, **config_kwargs):
    torch.manual_seed(seed)
    config = tiny_deepseek_config(**config_kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_weights(model)
    model.save_pretrained(folder)
    if with_absorbed:
        write_absorbed(folder, model.state_dict(), config)
    tiny_tokenizer().save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"mla-{request.param}")
    model = _save_random_mla(folder, **CONFIGS[request.param])
    return folder, model, MLAEngine.from_pretrained(folder, compute_dtype="float32")  # exactness: float32


def _reference_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]  # (T, V)


def test_logits_equal_transformers_every_step_of_64(checkpoint):
    _, model, engine = checkpoint
    [result] = engine.generate([PROMPTS[0]], max_new_tokens=64, eos_token_ids=[], return_logits=True)
    assert len(result.tokens) == 64 and result.finish_reason == "length"
    reference = _reference_logits(model, result.prompt_tokens + result.tokens)
    start = len(result.prompt_tokens) - 1
    expected = reference[start : start + 64]  # the logits that chose each generated token
    assert reference.abs().max() > 1.0  # the comparison is not between near-zero logits
    torch.testing.assert_close(result.logits, expected, atol=1e-4, rtol=0)
    assert result.tokens == expected.argmax(-1).tolist()


def test_cache_holds_what_transformers_caches(checkpoint):
    """After prefill, row b of the latent cache equals transformers' DeepseekV3 cache: the normalised latent
    (r values) and the rotated rope key (d_r values), nothing per head."""
    _, model, engine = checkpoint
    config = engine.model.config
    cache = engine.model.new_cache(len(PROMPTS), 16)
    engine.model.prefill(cache, PROMPTS)
    assert cache.lengths.tolist() == [len(p) for p in PROMPTS]
    for row, prompt in enumerate(PROMPTS):
        reference = DynamicCache(config=config)
        with torch.no_grad():
            model(torch.tensor([prompt]), cache=reference, use_cache=True)
        for layer in range(config.num_hidden_layers):
            stored = cache.layer(layer)[row, : len(prompt)]  # (T, r + d_r)
            expected_latent = reference.layers[layer].keys[0, 0]  # (T, r)
            expected_rope_key = reference.layers[layer].values[0, 0]  # (T, d_r)
            torch.testing.assert_close(stored[:, : config.kv_lora_rank], expected_latent, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(stored[:, config.kv_lora_rank :], expected_rope_key, atol=1e-5, rtol=1e-5)


def test_ragged_batch_equals_one_prompt_at_a_time(checkpoint):
    _, _, engine = checkpoint
    batch = engine.generate(PROMPTS, max_new_tokens=20, eos_token_ids=[], return_logits=True)
    for prompt, batched in zip(PROMPTS, batch):
        [alone] = engine.generate([prompt], max_new_tokens=20, eos_token_ids=[], return_logits=True)
        assert batched.tokens == alone.tokens
        torch.testing.assert_close(batched.logits, alone.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cache_bytes_are_latent_plus_rope_per_token_per_layer(checkpoint, dtype):
    folder, _, _ = checkpoint
    engine = MLAEngine.from_pretrained(folder, compute_dtype=str(dtype).removeprefix("torch."))
    config = engine.model.config
    tokens = 37
    cache = engine.model.new_cache(batch_size=2, max_tokens=tokens)
    element = torch.empty((), dtype=dtype).element_size()
    per_row = (config.kv_lora_rank + config.qk_rope_head_dim) * config.num_hidden_layers * tokens * element
    assert cache.nbytes == 2 * per_row
    assert cache.data.dtype == dtype and cache.data.untyped_storage().nbytes() == cache.nbytes


def test_eos_stops_only_its_row(checkpoint):
    _, _, engine = checkpoint
    free = engine.generate(PROMPTS[:2], max_new_tokens=12, eos_token_ids=[])
    eos = free[0].tokens[4]
    stop_at = free[0].tokens.index(eos)  # the first time row 0 emits it
    stopped = engine.generate(PROMPTS[:2], max_new_tokens=12, eos_token_ids=[eos])
    assert stopped[0].tokens == free[0].tokens[: stop_at + 1]
    assert stopped[0].finish_reason == "eos"
    if eos not in free[1].tokens:
        assert stopped[1].tokens == free[1].tokens and stopped[1].finish_reason == "length"
    else:
        assert stopped[1].tokens == free[1].tokens[: free[1].tokens.index(eos) + 1]


def test_sampling_is_reproducible_with_a_seed(checkpoint):
    _, _, engine = checkpoint
    kwargs = {"max_new_tokens": 24, "temperature": 1.5, "top_p": 0.95, "eos_token_ids": []}
    first = engine.generate(PROMPTS, seed=123, **kwargs)
    again = engine.generate(PROMPTS, seed=123, **kwargs)
    other = engine.generate(PROMPTS, seed=124, **kwargs)
    greedy = engine.generate(PROMPTS, max_new_tokens=24, eos_token_ids=[])
    assert [r.tokens for r in first] == [r.tokens for r in again]
    assert [r.tokens for r in first] != [r.tokens for r in other]
    assert [r.tokens for r in first] != [r.tokens for r in greedy]


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    generator = torch.Generator().manual_seed(0)
    drawn = {int(sample_next(logits, 1.0, 0.75, generator)) for _ in range(300)}
    assert drawn == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3
    assert int(sample_next(logits, 1.0, 1e-6, generator)) == 0  # a tiny top-p is greedy
    assert int(sample_next(logits, 0.0, 1.0, None)) == 0


def test_streamed_text_is_the_final_text(checkpoint):
    _, _, engine = checkpoint
    pieces: dict[int, list[str]] = {0: [], 1: []}
    results = engine.generate(["the latent ", "def add("], max_new_tokens=30, eos_token_ids=[],
                              stream=lambda row, text: pieces[row].append(text))
    for row, result in enumerate(results):
        assert result.text and "".join(pieces[row]) == result.text


def test_cli_streams_generated_text(checkpoint, capsys):
    folder, _, engine = checkpoint
    [expected] = engine.generate(["the latent "], max_new_tokens=10, eos_token_ids=[])
    code, out, err = run_cli(["generate", folder, "--prompt", "the latent ", "--max-new-tokens", "10",
                              "--ignore-eos", "--compute-dtype", "float32"], capsys)
    assert code == 0, err
    assert out.rstrip("\n") == expected.text


def test_cli_without_absorbed_weights_says_so(tmp_path, capsys):
    _save_random_mla(tmp_path, with_absorbed=False)
    code, _, err = run_cli(["generate", tmp_path, "--prompt", "hi"], capsys)
    assert code == 2
    assert "no absorbed weights" in err and "Traceback" not in err
    with pytest.raises(UserError):
        MLAEngine.from_pretrained(tmp_path)


def test_prompt_not_utf8_and_seed_out_of_range_are_user_errors(checkpoint):
    """The library refuses what the CLI's config refuses: text the tokenizer cannot encode, a seed past 2**32 - 1."""
    _, _, engine = checkpoint
    with pytest.raises(UserError, match=r"the prompt holds bytes that are not UTF-8 \(0xff at character 3\)"):
        engine.generate(["ab\udcff"], max_new_tokens=1)
    for seed in (-1, 2**32, 10**23):
        with pytest.raises(UserError, match="--seed must be a whole number from 0 to 4294967295"):
            engine.generate([PROMPTS[1]], max_new_tokens=1, temperature=1.0, seed=seed)


def test_kernel_decode_attention_equals_torch(checkpoint, monkeypatch):
    """The model's call into mha2mla.kernels' split-KV decode (natively on a GPU, in Triton's interpreter on CPU:
    tests/conftest.py sets TRITON_INTERPRET=1 there) gives the logits of the plain PyTorch absorbed attention,
    on a ragged batch, and really runs the kernel at every decode step of every layer."""
    import mha2mla.kernels.decode as triton_decode

    calls = []
    real = triton_decode.mla_decode_latent_triton
    monkeypatch.setattr(triton_decode, "mla_decode_latent_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    folder, _, engine = checkpoint
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernel_engine = MLAEngine.from_pretrained(folder, device=device, compute_dtype="float32", decode_attention="kernel")
    assert engine.model.decode_backend == "reference" and kernel_engine.model.decode_backend == "triton"
    expected = engine.generate(PROMPTS, max_new_tokens=6, eos_token_ids=[], return_logits=True)
    got = kernel_engine.generate(PROMPTS, max_new_tokens=6, eos_token_ids=[], return_logits=True)
    assert len(calls) == 5 * engine.model.config.num_hidden_layers  # every decode step of every layer
    for a, b in zip(got, expected):
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=0)


def test_kernel_decode_attention_where_triton_cannot_run_is_a_user_error(checkpoint, monkeypatch):
    folder, _, _ = checkpoint
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors without the interpreter: no Triton
    with pytest.raises(UserError, match="cannot run on cpu"):
        MLAEngine.from_pretrained(folder, device="cpu", decode_attention="kernel")


def test_unknown_decode_attention_is_a_user_error(checkpoint):
    folder, _, _ = checkpoint
    with pytest.raises(UserError):
        MLAEngine.from_pretrained(folder, decode_attention="flash")


def test_bfloat16_engine_stays_close_to_float32(checkpoint):
    folder, _, engine = checkpoint
    model_32, model_16 = engine.model, MLAEngine.from_pretrained(folder, compute_dtype="bfloat16").model
    cache_32, cache_16 = model_32.new_cache(len(PROMPTS), 16), model_16.new_cache(len(PROMPTS), 16)
    logits_32, logits_16 = model_32.prefill(cache_32, PROMPTS), model_16.prefill(cache_16, PROMPTS)
    for _ in range(4):
        assert logits_16.dtype == torch.float32 and cache_16.data.dtype == torch.bfloat16
        torch.testing.assert_close(logits_16, logits_32, atol=0.25, rtol=0)  # logits of several units
        tokens = logits_32.argmax(-1)
        logits_32, logits_16 = model_32.decode(cache_32, tokens), model_16.decode(cache_16, tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_rms_norm_is_transformers_rmsnorm_and_keeps_float32_on_request(dtype):
    """The default mode is transformers' DeepseekV3RMSNorm bit for bit (normalise in fp32, cast back, scale);
    keep_float32 scales the fp32 normalised values, so it differs from the default only in 16-bit dtypes."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 48, generator=generator) * 7).to(dtype)
    norm = DeepseekV3RMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=generator) + 0.5)
        expected = norm(x)
    got = rms_norm(x, norm.weight.detach(), 1e-5)
    assert got.dtype == dtype and torch.equal(got, expected)
    wide = rms_norm(x, norm.weight.detach().float(), 1e-5, keep_float32=True)
    x32 = x.float()
    assert wide.dtype == torch.float32
    torch.testing.assert_close(wide, norm.weight.float() * x32 / (x32.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt())
    assert torch.equal(wide, got.float()) == (dtype == torch.float32)


ROPE_SCALINGS = {
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
             "mscale_all_dim": 1.0, "mscale": 1.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                 "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 3.0, 5.0, 8.0]},
}


@pytest.mark.parametrize("scaling", list(ROPE_SCALINGS))
def test_rope_scaling_matches_transformers_cached_decode(scaling, tmp_path):
    """Scaled rope (and yarn's softmax mscale) as transformers applies it, step by step with its cache. (For
    longrope transformers switches all frequencies to the long factors once a forward pass reaches past
    original_max_position_embeddings, so its cached decode and a one-shot forward differ; we follow the former.)"""
    model = _save_random_mla(tmp_path, rope_parameters=ROPE_SCALINGS[scaling])
    engine = MLAEngine.from_pretrained(tmp_path, compute_dtype="float32")
    [result] = engine.generate([PROMPTS[0]], max_new_tokens=40, eos_token_ids=[], return_logits=True)
    tokens = torch.tensor([result.prompt_tokens + result.tokens])
    prompt_length = len(result.prompt_tokens)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        expected = [model(tokens[:, :prompt_length], cache=cache, use_cache=True).logits[0, -1]]
        for step in range(39):
            position = prompt_length + step
            expected.append(model(tokens[:, position : position + 1], cache=cache, use_cache=True).logits[0, -1])
    torch.testing.assert_close(result.logits, torch.stack(expected), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_converted_smollm2_matches_transformers(tmp_path):
    """The real SmolLM2-135M converted at 12.5 % KV: engine logits equal transformers' DeepseekV3 (fp32, logits
    of magnitude ~30, so a looser absolute tolerance than on the tiny models), 5,760 cache bytes per token."""
    import subprocess

    from mha2mla.io.cache import cache_dir, cached_default_model  # `make test-slow` fetches it first

    folder = cache_dir() / "converted" / "smollm2-135m-kv0.125"
    if not (folder / "absorbed.json").exists():
        folder = tmp_path / "smollm2-135m-kv0.125"
        subprocess.run([sys.executable, "-m", "mha2mla.cli.main", "convert", str(cached_default_model()), str(folder),
                        "--kv-budget", "0.125", "--profile", "portable", "--no-progress"], check=True)
    engine = MLAEngine.from_pretrained(folder, compute_dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    [result] = engine.generate(["The kingdom of heaven is like unto a"], max_new_tokens=16, eos_token_ids=[],
                               return_logits=True)
    reference = _reference_logits(model, result.prompt_tokens + result.tokens)
    start = len(result.prompt_tokens) - 1
    torch.testing.assert_close(result.logits, reference[start : start + 16], atol=2e-3, rtol=0)
    assert engine.model.new_cache(1, 1).nbytes == 5760
