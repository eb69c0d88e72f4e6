"""A real llama.cpp (llama-cpp-python from PyPI) runs the exported SmolLM2-135M 31.25% conversion as ``deepseek2``
and agrees with transformers on the same converted folder (docs/engines.md): `make test-engines`.

Measured with llama-cpp-python 0.3.36 on CPU; the figures are in docs/engines.md. Set MHA2MLA_SMOLLM2_KV31 to a
folder already converted with `mha2mla convert <default GGUF> OUT --kv-budget 0.3125` to skip the conversion here.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mha2mla.convert.config import ConvertConfig
from mha2mla.convert.pipeline import convert
from mha2mla.export import export_gguf
from mha2mla.io.cache import cached_default_model  # `make test-engines` fetches it first

pytestmark = pytest.mark.slow
llama_cpp = pytest.importorskip("llama_cpp", reason="needs llama-cpp-python: run `make test-engines`")
llama_logger = pytest.importorskip("llama_cpp._logger")  # llama-cpp-python's own log callback
llama_bindings = pytest.importorskip("llama_cpp.llama").llama_cpp  # the ctypes bindings Llama() calls

GGML_TYPE_F32, GGML_TYPE_F16 = 0, 1  # ggml_type values for the KV cache
CACHE_VALUE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
N_CTX = 8192  # SmolLM2's context; 30 layers x 120 values x 2 or 4 bytes x 8192 cells: a whole number of 1/100 MiB
GREEDY_TOKENS = 32
TEXT = (
    "The lighthouse keeper climbed the narrow stairs every evening at dusk. He trimmed the wick, polished the "
    "great lens and wrote the weather in a small book: wind from the west, a light rain, three ships seen before "
    "noon on the 14th of March 1887. In winter the storms came often, and he would sit by the lamp for hours, "
    "listening to the sea strike the rocks below. His daughter learned to read from that book. She counted the "
    "ships, drew the clouds in the margins, and asked why the light had to turn all night when nobody was watching. "
    "Because someone always is, he told her, even when we cannot see them. Years later, when the lighthouse was "
    "automated and the keeper had long retired, she still kept a lamp burning in her window."
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    given = os.environ.get("MHA2MLA_SMOLLM2_KV31")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("smollm2") / "kv31"
    # the GGUF itself, as `mha2mla convert <gguf> OUT --kv-budget 0.3125` gets it (a bf16 output)
    convert(cached_default_model(), out, ConvertConfig(kv_budget=0.3125), progress=False)
    return out


@pytest.fixture(scope="module")
def report(converted) -> dict:
    data = json.loads((converted / "conversion_report.json").read_text())
    assert data["plan"]["kv_lora_rank"] + data["plan"]["rope_dim"] == 120 and data["profile"] == "portable"
    return data


@pytest.fixture(scope="module")
def gguf_f32(converted, tmp_path_factory) -> Path:
    return export_gguf(converted, tmp_path_factory.mktemp("gguf") / "kv31-f32.gguf", "f32")


@pytest.fixture(scope="module")
def hf(converted):
    return AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ids(converted) -> list[int]:
    return AutoTokenizer.from_pretrained(converted)(TEXT)["input_ids"]


class LlamaLog:
    """Collects llama.cpp's own log text (it reports the KV buffers it allocates) inside a ``with`` block; llama-cpp-
    python's own logger is put back on exit, before this callback can be freed."""

    def __init__(self):
        self.text: list[str] = []
        self._callback = llama_cpp.llama_log_callback(self._collect)

    def __enter__(self):
        llama_cpp.llama_log_set(self._callback, ctypes.c_void_p(0))
        return self

    def __exit__(self, *exc):
        llama_cpp.llama_log_set(llama_logger.llama_log_callback, ctypes.c_void_p(0))

    def _collect(self, level, text, user_data):
        self.text.append(text.decode("utf-8", errors="replace"))

    def kv_cache(self) -> dict:
        """The last ``llama_kv_cache: size = ...`` line: cells, layers and the K / V buffer sizes in bytes."""
        pattern = (r"llama_kv_cache: size = +[\d.]+ MiB \( *(\d+) cells, +(\d+) layers.*?K \((\w+)\): +([\d.]+) MiB, "
                   r"V \((\w+)\): +([\d.]+) MiB")
        cells, layers, k_type, k_mib, v_type, v_mib = re.findall(pattern, "".join(self.text))[-1]
        return {"cells": int(cells), "layers": int(layers), "k_type": k_type, "v_type": v_type,
                "k_bytes": float(k_mib) * 2**20, "v_bytes": float(v_mib) * 2**20}


def load(path: Path, **options):
    """A llama.cpp model + context on the CPU, without the CPU backend's extra buffer types (AMX, weight repacking):
    on the VM this was measured on, the natively built AMX path dies with SIGILL on any block-quantised model, the
    source's own Q4_1 GGUF included (docs/engines.md)."""
    default_params = llama_bindings.llama_model_default_params

    def without_extra_buffers():
        params = default_params()
        params.use_extra_bufts = False
        return params

    llama_bindings.llama_model_default_params = without_extra_buffers
    try:
        return llama_cpp.Llama(model_path=str(path), n_ctx=options.pop("n_ctx", 1024), n_batch=512, n_ubatch=512,
                               logits_all=True, n_threads=max(1, min(4, os.cpu_count() or 1)), verbose=False, **options)
    finally:
        llama_bindings.llama_model_default_params = default_params


def llama_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float64)


def llama_greedy(llm, ids: list[int], n: int) -> list[int]:
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(out[-1:])
    return out


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy tokens from transformers, the whole sequence recomputed each step (no cache API involved)."""
    out: list[int] = []
    for _ in range(n):
        out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


def test_f32_gguf_logits_top1_and_greedy_match_transformers(gguf_f32, hf, ids):
    """Acceptance: max |Δlogit| < 1e-3 at f32 (weights and K cache), top-1 ≥ 99%, the same 32 greedy tokens."""
    llm = load(gguf_f32, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)  # MLA: one cache type for K and V
    assert llm.tokenize(TEXT.encode(), add_bos=True, special=False) == ids  # llama.cpp tokenises as transformers
    got = llama_logits(llm, ids)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].double().numpy()
    max_diff = float(np.abs(got - expected).max())
    top1 = float((got.argmax(-1) == expected.argmax(-1)).mean())
    greedy_llama, greedy_hf = llama_greedy(llm, ids, GREEDY_TOKENS), hf_greedy(hf, ids, GREEDY_TOKENS)
    print(f"\nllama.cpp f32 vs transformers over {len(ids)} positions: max |dlogit| {max_diff:.3g}, top-1 {top1:.2%}, "
          f"greedy {GREEDY_TOKENS} identical: {greedy_llama == greedy_hf}")
    llm.close()
    assert max_diff < 1e-3 and top1 >= 0.99
    assert greedy_llama == greedy_hf


def test_kv_cache_holds_rank_plus_rope_values_per_token_and_layer(gguf_f32, report):
    """llama.cpp's MLA cache: one K row of kv_lora_rank + rope dims per token and layer and no V buffer. With a cache
    type of the checkpoint's value size (f16 for bf16, f32 for f32) its bytes per token are the plan's figure.
    llama.cpp prints the buffers in MiB to two decimals, exact here (8192 cells)."""
    plan = report["plan"]
    width, value_bytes = plan["kv_lora_rank"] + plan["rope_dim"], CACHE_VALUE_BYTES[plan["dtype"]]
    cache_type = GGML_TYPE_F32 if value_bytes == 4 else GGML_TYPE_F16
    with LlamaLog() as log:
        load(gguf_f32, n_ctx=N_CTX, type_k=cache_type, type_v=cache_type).close()
    kv = log.kv_cache()
    print(f"\nllama.cpp KV cache: {kv}; {kv['k_bytes'] / (kv['cells'] * kv['layers'] * value_bytes):g} values per token "
          f"per layer, {(kv['k_bytes'] + kv['v_bytes']) / kv['cells']:g} bytes per token; plan {report['kv_bytes_per_token']}")
    assert kv["cells"] >= N_CTX and kv["layers"] == 30 and kv["v_bytes"] == 0
    assert abs(kv["k_bytes"] - width * value_bytes * kv["cells"] * kv["layers"]) <= 0.005 * 2**20  # one value less: 0.47 MiB
    assert width * value_bytes * kv["layers"] == report["kv_bytes_per_token"]["converted"]


@pytest.mark.parametrize(("tensor_type", "least_top1"), [("f16", 0.99), ("q8_0", 0.95)])
def test_smaller_exports_stay_close(converted, hf, ids, tensor_type, least_top1, tmp_path):
    """Half and 8-bit exports with llama.cpp's default f16 cache: the same next token (almost) everywhere."""
    llm = load(export_gguf(converted, tmp_path / f"kv31-{tensor_type}.gguf", tensor_type))
    got = llama_logits(llm, ids)
    llm.close()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].double().numpy()
    top1 = float((got.argmax(-1) == expected.argmax(-1)).mean())
    print(f"\nllama.cpp {tensor_type} vs transformers: max |dlogit| {np.abs(got - expected).max():.3g}, top-1 {top1:.2%}")
    assert top1 >= least_top1


@pytest.fixture(scope="module")
def recovered(converted, tmp_path_factory) -> Path:
    """The 31.25% conversion after a short `mha2mla recover` (full attention, LM loss on the text above): the merged
    output a user exports, with every attention weight moved by training."""
    from mha2mla.train import RecoverConfig, recover

    work = tmp_path_factory.mktemp("recovered")
    (work / "text.txt").write_text((TEXT + "\n") * 40)
    out = work / "out"
    recover(RecoverConfig(model=str(converted), data=[str(work / "text.txt")], out=str(out), seq_len=64, batch_size=2,
                          max_steps=3, learning_rate=1e-4, full_attention=True, eval_sequences=0, save_every=0),
            show_progress=False)
    return out


def test_a_recovered_model_exports_and_runs_in_llama_cpp_as_the_converted_one(recovered, converted, ids, tmp_path):
    """Recovery changes the weights, not the format: the merged output exports, llama.cpp's f32 logits match
    transformers' on it, and its KV cache is the converted model's (the same config, the same bytes per token).

    The logits are held to transformers in float64, the exact value of these weights, within 1e-3 or five times
    transformers' own float32 distance from it, whichever is larger: three steps that move attention can leave the
    first position's MLP summing large weights into a small output (where the conversion kept its massive activation),
    and there float32 rounding alone moves the logits past 1e-3, in transformers and more in llama.cpp
    (docs/engines.md). A wrong format is off by orders more; top-1 agreement is held as for the conversion."""
    config, before = (json.loads((folder / "config.json").read_text()) for folder in (recovered, converted))
    shared = (set(config) & set(before)) - {"dtype", "transformers_version"}
    assert shared >= {"kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "num_hidden_layers"}
    assert {k: config[k] for k in shared} == {k: before[k] for k in shared}
    model = AutoModelForCausalLM.from_pretrained(recovered, dtype=torch.float32).eval()
    source_weights = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).state_dict()
    moved = [name for name, tensor in model.state_dict().items() if not torch.equal(tensor, source_weights[name])]
    assert moved and all(".self_attn." in name for name in moved)
    with LlamaLog() as log:
        llm = load(export_gguf(recovered, tmp_path / "recovered-f32.gguf", "f32"), type_k=GGML_TYPE_F32,
                   type_v=GGML_TYPE_F32)
    got = llama_logits(llm, ids)
    llm.close()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].double().numpy()
        exact = model.double()(torch.tensor([ids])).logits[0].numpy()
    max_diff, rounding = float(np.abs(got - exact).max()), float(np.abs(expected - exact).max())
    top1 = float((got.argmax(-1) == expected.argmax(-1)).mean())
    kv = log.kv_cache()
    print(f"\nrecovered, max |dlogit| from transformers float64: llama.cpp f32 {max_diff:.3g}, transformers float32 "
          f"{rounding:.3g}; top-1 {top1:.2%}; KV {kv}")
    assert max_diff < max(1e-3, 5 * rounding) and top1 >= 0.99
    width = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    assert kv["v_bytes"] == 0 and abs(kv["k_bytes"] - width * 4 * kv["cells"] * kv["layers"]) <= 0.005 * 2**20
