"""The conversion plan: every choice resolved once — profile, ranks, rope pairs, methods, calibration
— into a frozen :class:`ConversionPlan` that the pipeline, the per-layer conversion and the report
read. Nothing downstream re-decides."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import torch

from mha2mla import UserError
from mha2mla.compute import resolve_compute_dtype
from mha2mla.convert.config import ConvertConfig
from mha2mla.convert.plan.engines import Engine, engine, engine_shape
from mha2mla.convert.plan.methods import Methods, product_methods
from mha2mla.convert.plan.shape import DTYPES, SourceShape
from mha2mla.convert.steps.rope import default_rope_stride, kept_pairs, target_rope_theta, validate_rope_dim
from mha2mla.devices import resolve_device
from mha2mla.families import Family

log = logging.getLogger(__name__)

def default_rope_dim(total_values: int, rotating_dims: int) -> int:
    """About a quarter of the cache for the rope key, in steps of 8, at most the dims that rotate."""
    return max(2, min(rotating_dims, 8 * round(total_values / 32)))


@dataclass(frozen=True)
class CalibrationSettings:
    """Where the built-in calibration provider takes its tokens from (docs/calibration.md)."""

    text: str  # `default` (bundled sample), a file, a folder or a dataset id
    samples: int  # N sequences
    seq_len: int  # of L tokens
    device: str | None  # None: cuda if available
    max_memory: float | None = None  # GiB for one calibrated layer on the host (memory.py); None: what is available


@dataclass(frozen=True)
class ConversionPlan:
    family: str
    profile: str
    target: str  # the engine the shapes suit (engines.ENGINES)
    shape: SourceShape
    rope_dim: int
    v_head_dim: int  # the source head dim, or more where the target needs it (V rows and o_proj zero-padded)
    rope_pairs: tuple[int, ...]  # source pairs kept as rope, in target order
    target_rope_theta: float
    latent_rank: int  # real latent channels
    kv_lora_rank: int  # the config's value: latent_rank + the kv_norm method's extra channels
    dtype: str
    use_q_lora: bool  # exact profile with a q bias: q through q_a_proj (bias) + a neutralised norm
    untie_embeddings: bool
    methods: Methods
    calibration: CalibrationSettings | None  # None: weight-only, or statistics supplied by the caller
    compute_dtype: str = "float32"  # of the calibration's forwards and the reconstruction (mha2mla/compute.py)
    max_shard_size: int = 2 * 1024**3
    biases: dict[str, bool] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    @property
    def extra_channels(self) -> int:
        return self.kv_lora_rank - self.latent_rank

    @property
    def keeps_rope_scaling(self) -> bool:
        """The exact profile writes the source's rope scaling into the target config (on the kept pairs)."""
        return self.profile == "exact" and self.shape.rope_scaling != "default"

    @property
    def calibrated(self) -> bool:
        return self.methods.needs_statistics

    def method_summary(self) -> str:
        """One line naming what runs (the dry run and the model card state it)."""
        m = self.methods
        if not self.calibrated:
            return ("weight-only (SVD of the K/V weights, no calibration): fast, but quality is poor without "
                    "`mha2mla recover`")
        where = "statistics supplied by the caller" if self.calibration is None else (
            f"{'the bundled sample' if self.calibration.text == 'default' else self.calibration.text}, "
            f"{self.calibration.samples} x {self.calibration.seq_len} tokens, computed in {self.compute_dtype}")
        return (f"calibrated on {where}: {m.rope_mixing} rope mixing, {m.rope_compensation} rope compensation, "
                f"{m.lowrank} low rank, {m.kv_norm} kv_a_layernorm, refit {'on' if m.refit != 'none' else 'off'}, "
                f"reconstruction {'on' if m.reconstruct != 'none' else 'off'}, {'sequential' if m.sequential else 'source-stream'} statistics")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def kv_bytes_per_token(self) -> dict[str, float]:
        bytes_per_value = self.torch_dtype.itemsize
        source = self.shape.kv_values_per_token_per_layer * self.shape.num_layers * bytes_per_value
        target = (self.kv_lora_rank + self.rope_dim) * self.shape.num_layers * bytes_per_value
        return {"source": source, "converted": target, "ratio": target / source}

    def attention_parameters(self) -> dict[str, int]:
        s = self.shape
        D, H, G, d, r = s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, self.kv_lora_rank
        source = (H * d + 2 * G * d) * D + D * H * d
        q_rows = H * (d + self.rope_dim)
        q_params = (D + 1) * D + q_rows * (D + 1) if self.use_q_lora else q_rows * D
        target = q_params + (r + self.rope_dim) * D + r + H * (d + self.v_head_dim) * r + D * H * self.v_head_dim
        return {"source_per_layer": source, "converted_per_layer": target,
                "source_total": source * s.num_layers, "converted_total": target * s.num_layers}

    def to_dict(self) -> dict:
        data = asdict(self)
        data["rope_pairs"] = list(self.rope_pairs)
        data["warnings"] = list(self.warnings)
        data["method"] = self.method_summary()
        data["kv_bytes_per_token"] = self.kv_bytes_per_token()
        data["attention_parameters"] = self.attention_parameters()
        return data


def _output_dtype(config: dict, options: ConvertConfig, source_format: str, rules: Engine) -> str:
    """``auto``: what the target engine serves (bfloat16 for the GPU engines), else the source's dtype —
    bfloat16 for a GGUF source, whose dequantised copy is float32 but whose weights never had float32
    precision (a float32 output would be several times its size for nothing)."""
    if options.dtype != "auto":
        return options.dtype
    if rules.dtype is not None:
        return rules.dtype
    if source_format == "gguf":
        return "bfloat16"
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    return name if name in DTYPES else "float32"


def _sizes(shape: SourceShape, options: ConvertConfig, extra_channels: int, rules: Engine) -> tuple[int, int, int, list[str]]:
    """(kv_lora_rank, rope_dim, v_head_dim, warnings) from the budget or the explicit ranks, in shapes the
    target engine accepts."""
    warnings = []
    if rules.rope_dims or rules.cache_widths or rules.rank_multiple or rules.head_shapes:
        total = round(options.budget * shape.kv_values_per_token_per_layer)
        chosen = engine_shape(rules, shape.head_dim, shape.kv_values_per_token_per_layer,
                              shape.max_latent_rank + extra_channels, budget=options.budget,
                              kv_lora_rank=options.kv_lora_rank, rope_dim=options.rope_dim,
                              default_rope_dim=default_rope_dim(total, shape.rotating_dims), rotating_dims=shape.rotating_dims)
        if chosen.note:
            warnings.append(chosen.note)
        if chosen.kv_lora_rank - extra_channels < 1:
            raise UserError(f"kv_lora_rank {chosen.kv_lora_rank} leaves no latent channel beside the extra channel.")
        return chosen.kv_lora_rank, chosen.rope_dim, chosen.v_head_dim, warnings
    if options.kv_lora_rank is not None:
        kv_lora_rank, rope_dim = options.kv_lora_rank, options.rope_dim
    else:
        total = round(options.budget * shape.kv_values_per_token_per_layer)
        rope_dim = default_rope_dim(total, shape.rotating_dims)
        kv_lora_rank = total - rope_dim
    validate_rope_dim(shape.rotating_dims, rope_dim)
    latent_rank = kv_lora_rank - extra_channels
    if options.kv_lora_rank is not None and latent_rank > shape.max_latent_rank:
        raise UserError(
            f"--kv-lora-rank {kv_lora_rank} asks for {latent_rank} latent channels, more than a layer can use "
            f"({shape.max_latent_rank} = min(hidden size, 2 x KV heads x head dim)); the full-capacity value is "
            f"{shape.max_latent_rank + extra_channels}."
        )
    if latent_rank < 1:
        raise UserError(
            f"the KV budget ({kv_lora_rank + rope_dim} values per token per layer) leaves no latent channel beside "
            f"{rope_dim} rope dims{' and the extra channel' if extra_channels else ''}; raise --kv-budget or lower --rope-dim."
        )
    if latent_rank > shape.max_latent_rank:
        warnings.append(f"latent rank {latent_rank} exceeds what a layer can use ({shape.max_latent_rank}); clamped.")
        kv_lora_rank = shape.max_latent_rank + extra_channels
    return kv_lora_rank, rope_dim, shape.head_dim, warnings


def _source_warnings(config: dict, family: Family, exact: bool) -> list[str]:
    warnings = []
    if family.qk_norm:
        warnings.append("the per-head q/k RMSNorm has no place in the DeepSeek format: it is replaced by its best linear "
                        "stand-in, so this conversion is approximate even at full capacity.")
    rope = config.get("rope_parameters") or {}
    if not exact and rope.get("rope_type", "default") not in ("default", None):
        warnings.append(
            f"source rope scaling {rope.get('rope_type')!r} is not portable; the portable checkpoint carries plain rope "
            "(exact for kept frequencies that the scaling leaves untouched)."
        )
    window = config.get(family.sliding_window_key) if family.sliding_window_key else None
    if window and window < config.get("max_position_embeddings", 0):
        warnings.append(f"source sliding window {window} is dropped: MLA attends to the whole context.")
    return warnings


def make_plan(config: dict, family: Family, options: ConvertConfig, *, source_format: str = "safetensors") -> ConversionPlan:
    """Resolve every choice once: the product's method set for ``options`` (plan/methods.py), sizes, dtypes and
    the calibration settings. ``source_format``: ``gguf`` sources (quantised or half precision) default to a
    bfloat16 output."""
    shape = SourceShape.from_config(config, family)  # its sizes checked there (heads split evenly among KV heads)
    if shape.head_dim % 2:
        raise UserError(f"head dim {shape.head_dim} is odd; RoPE needs an even head dim.")
    exact = options.profile == "exact"
    rules = engine(options.target)
    if options.profile not in rules.profiles:
        raise UserError(f"--target {options.target} serves the portable profile only ({rules.label} has no attention "
                        "biases); drop --profile exact.")
    calibrated = options.calibrated
    methods = product_methods(options.profile, calibrated, options.reconstruct)
    methods.check(options.profile)
    if methods.needs_statistics and not calibrated:
        raise ValueError("internal error: a method set that needs statistics on the weight-only path")
    activation = config.get("hidden_act", "silu")
    if not exact and activation != "silu":
        raise UserError(f"the source MLP uses {activation}, but serving engines' DeepSeek MLP is silu only; use --profile exact.")
    kv_lora_rank, rope_dim, v_head_dim, warnings = _sizes(shape, options, methods.extra_channels, rules)
    warnings += _source_warnings(config, family, exact)
    for message in warnings:
        log.warning(message)
    biases = {p: family.has_bias(p, config) for p in "qkvo"}
    untie = options.untie_embeddings if options.untie_embeddings is not None else not exact
    untie = untie or shape.embedding_scale != 1.0 or shape.logits_scale != 1.0  # tied weights would carry one scale
    stride = options.rope_stride or default_rope_stride(shape.rotating_dims, rope_dim)
    calibration = None
    if methods.needs_statistics:
        samples = options.calib_samples_for(shape.hidden_size)
        calibration = CalibrationSettings(options.calib, samples, options.calib_seq_len, options.calib_device,
                                          options.max_memory)
    compute_dtype = "float32"  # the weight-only path computes nothing in a stream
    if calibrated:
        compute_dtype = resolve_compute_dtype(options.compute_dtype, resolve_device(options.calib_device, "--calib-device"))
    return ConversionPlan(
        family=family.name,
        profile=options.profile,
        target=options.target,
        shape=shape,
        rope_dim=rope_dim,
        v_head_dim=v_head_dim,
        rope_pairs=tuple(kept_pairs(shape.rotating_dims, rope_dim, stride)),
        target_rope_theta=target_rope_theta(shape.rope_theta, shape.rotating_dims, rope_dim, stride),
        latent_rank=kv_lora_rank - methods.extra_channels,
        kv_lora_rank=kv_lora_rank,
        dtype=_output_dtype(config, options, source_format, rules),
        use_q_lora=exact and biases["q"],
        untie_embeddings=untie and bool(config.get("tie_word_embeddings", False)),
        methods=methods,
        calibration=calibration,
        compute_dtype=compute_dtype,
        max_shard_size=options.max_shard_size,
        biases=biases,
        warnings=tuple(warnings),
    )
