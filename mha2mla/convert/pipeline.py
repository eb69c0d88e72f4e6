"""``convert(source, out, options)``: the whole conversion, one layer at a time (docs/design.md, "architecture").

Reads the source lazily through one SourceReader, and for each layer: the calibration stream enters it and
measures it, the plan's steps convert its attention (convert/steps/), the stream advances through it; the
embeddings, norms and MLPs are copied as they are. Everything is written, in the output dtype, into a
temporary folder that is renamed to OUT only when everything (config, tokenizer, absorbed weights, report,
card, checks) is written.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm
from transformers import DeepseekV3Config

from mha2mla import __version__
from mha2mla.convert.calibration.measure import measure
from mha2mla.convert.calibration.stream import CalibrationStream, calibration_stream
from mha2mla.convert.config import ConvertConfig
from mha2mla.convert.output.portable import portable_violations
from mha2mla.convert.output.serving import serving_sections
from mha2mla.convert.output.target_config import deepseek_config
from mha2mla.convert.phases import PhaseClock, phase
from mha2mla.convert.plan.engines import engine_violations
from mha2mla.convert.plan.resolve import ConversionPlan, make_plan
from mha2mla.convert.source_reader import SourceReader
from mha2mla.convert.steps.attention import convert_attention
from mha2mla.convert.steps.norm import balance_latent
from mha2mla.convert.steps.records import LayerStatistics, LayerWork
from mha2mla.devices import check_device
from mha2mla.families import family_for_config
from mha2mla.io.card import write_model_card
from mha2mla.io.model_folder import (
    ABSORBED_FILE,
    CONFIG_FILE,
    GENERATION_CONFIG,
    TOKENIZER_FILES,
    ConversionReport,
    is_gguf_name,
    write_conversion_report,
)
from mha2mla.io.output import check_destination, check_replaceable, staged_output
from mha2mla.io.source import open_source
from mha2mla.io.writer import ShardedWriter
from mha2mla.modeling.absorbed import write_absorbed

log = logging.getLogger(__name__)


@dataclass
class ConversionResult:
    out: Path | None
    plan: ConversionPlan
    report: ConversionReport | None  # None on a dry run


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (ru_maxrss, KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _command_line() -> str:
    argv = [os.path.basename(sys.argv[0])] + sys.argv[1:]
    return " ".join(shlex.quote(a) for a in argv)


def _progress(iterable, total: int, enabled: bool, description: str):
    """A bar over the layers when ``enabled`` and stderr is a terminal (tqdm's ``disable=None``): a pipe or a log
    file gets no carriage-return redraws."""
    return tqdm(iterable, total=total, desc=description, unit="layer", disable=None) if enabled else iterable


def prepare_out(out: Path, force: bool, source: str | Path) -> None:
    """Refuse an OUT that is unsafe to write (mha2mla/io/output.py) before any work is done."""
    check_destination(out, [("the source model", source)])
    check_replaceable(out, force)


def convert(
    source: str | Path,
    out: str | Path | None,
    options: ConvertConfig | None = None,
    *,
    force: bool = False,
    dry_run: bool = False,
    progress: bool = True,
    command: str | None = None,
) -> ConversionResult:
    """Convert ``source`` (folder, .gguf or hub id) into a DeepSeek-V3 MLA checkpoint at ``out``, as ``options``
    say (the calibration text, sizes and device among them); ``command``: the command line the report records."""
    options = options or ConvertConfig()
    started = time.time()
    check_device(options.calib_device, "--calib-device")
    out = Path(out) if out is not None else None
    if out is not None and not dry_run:
        prepare_out(out, force, source)
    ckpt = open_source(source)
    family = family_for_config(ckpt.config)
    plan = make_plan(ckpt.config, family, options,
                     source_format="gguf" if is_gguf_name(source) else "safetensors")
    if dry_run or out is None:
        return ConversionResult(out=None, plan=plan, report=None)
    reader = SourceReader(ckpt, family, plan)
    stream = calibration_stream(reader) if plan.calibrated else None

    clock = PhaseClock(stream.device if stream is not None else None)
    with staged_output(out, force=force) as tmp, clock.running():  # swapped into OUT once everything is written
        report = _write_checkpoint(reader, tmp, stream, progress)
        report.source, report.command = str(source), command or _command_line()
        report.mha2mla_version, report.options = __version__, options.model_dump()
        report.elapsed_seconds = round(time.time() - started, 2)
        report.peak_rss_gib = round(peak_rss_bytes() / 1024**3, 3)
        if stream is not None and stream.device.type == "cuda":
            report.peak_gpu_gib = round(torch.cuda.max_memory_allocated(stream.device) / 1024**3, 3)
        with phase("writing"):
            write_model_card(tmp, report, serving_sections(report.plan))
        report.phase_seconds, report.phase_cpu_seconds = clock.totals()
        write_conversion_report(tmp, report)
    return ConversionResult(out=out, plan=plan, report=report)


def _convert_layer(reader: SourceReader, layer: int, stream: CalibrationStream | None) -> LayerWork:
    """One layer's attention: the stream enters the layer and measures it (no statistics on the weight-only path),
    the plan's steps convert it, and the stream advances through it (through the converted attention when
    sequential); the latent is written balanced against the layer's input (steps/norm.balance_latent)."""
    plan = reader.plan
    activations, stats = None, LayerStatistics()
    if stream is not None:
        with phase("layer read"):
            activations = stream.enter(layer)
        with phase("statistics"):
            stats = measure(activations)
    work = LayerWork(layer=layer, plan=plan, source=reader.attention(layer, stats), stats=stats, activations=activations)
    tensors = convert_attention(work)
    if stream is not None:
        with phase("advance"):
            stream.advance(activations, work.tensors if plan.methods.sequential else None)
    work.tensors = balance_latent(tensors, work.source.input_norm_weight, plan.kv_lora_rank)
    return work


def _write_checkpoint(reader: SourceReader, folder: Path, stream: CalibrationStream | None,
                      progress: bool) -> ConversionReport:
    plan, ckpt = reader.plan, reader.ckpt
    writer = ShardedWriter(folder, max_shard_bytes=plan.max_shard_size, dtype=plan.torch_dtype)
    writer.add("model.embed_tokens.weight", reader.embed())
    kv_b_weights, layers, dropped = {}, [], set()
    description = "converting" + (" (calibrated)" if plan.calibrated else " (weight-only)")
    for layer in _progress(range(plan.shape.num_layers), plan.shape.num_layers, progress, description):
        layer_started = time.time()
        work = _convert_layer(reader, layer, stream)
        work.report["seconds"] = round(time.time() - layer_started, 2)
        prefix = f"model.layers.{layer}"
        with phase("writing"):
            for name, tensor in work.tensors.items():
                writer.add(f"{prefix}.self_attn.{name}", tensor)
            writer.add(f"{prefix}.input_layernorm.weight", work.source.input_norm_weight)
            writer.add(f"{prefix}.post_attention_layernorm.weight", reader.tensor("post_attention_layernorm", layer))
            for key, tensor in reader.mlp(layer).items():
                writer.add(f"{prefix}.mlp.{key}.weight", tensor)
        kv_b_weights[f"{prefix}.self_attn.kv_b_proj.weight"] = work.tensors["kv_b_proj.weight"]
        layers.append({"layer": layer, **work.report})
        dropped.update(work.written.dropped_biases)
    with phase("writing"):
        writer.add("model.norm.weight", reader.tensor("final_norm"))
        if plan.untie_embeddings or not ckpt.config.get("tie_word_embeddings", False):
            writer.add("lm_head.weight", reader.lm_head())
        writer.finish()
        _write_metadata(ckpt, plan, folder, kv_b_weights)
    if dropped:
        log.warning("portable profile: source biases %s cannot be carried exactly and were dropped "
                    "(use --profile exact to keep them, or recover to heal).", sorted(dropped))
    return ConversionReport(
        layers=layers, family=plan.family, profile=plan.profile, plan=plan.to_dict(),
        kv_bytes_per_token=plan.kv_bytes_per_token(), initialisation=plan.method_summary(),
        methods=plan.methods.to_dict(), dropped_biases=sorted(dropped),
        portable_check="passed" if plan.profile == "portable" else "not applicable (exact profile)",
    )


def _write_metadata(ckpt, plan: ConversionPlan, folder: Path, kv_b_weights: dict) -> None:
    """config.json, generation config, tokenizer, absorbed weights; then the portable check."""
    config = deepseek_config(plan, ckpt.config)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write_generation_config(ckpt.folder, folder, ckpt.config)
    for name in TOKENIZER_FILES:
        if (ckpt.folder / name).exists():
            shutil.copy2(ckpt.folder / name, folder / name)
    write_absorbed(folder, kv_b_weights, DeepseekV3Config(**{k: v for k, v in config.items() if k != "mha2mla"}))
    problems = portable_violations(config, list(_written_names(folder))) if plan.profile == "portable" else []
    problems += engine_violations(plan.target, config, sorted(path.name for path in folder.iterdir()))
    if problems:
        raise RuntimeError(f"internal error: the output breaks a constraint of its target: {problems[0]}")


def _written_names(folder: Path):
    for shard in sorted(folder.glob("*.safetensors")):
        if shard.name == ABSORBED_FILE:
            continue
        with safe_open(str(shard), framework="pt") as handle:
            yield from handle.keys()


def _write_generation_config(source_folder: Path, folder: Path, source_config: dict) -> None:
    source = source_folder / GENERATION_CONFIG
    if source.exists():
        shutil.copy2(source, folder / GENERATION_CONFIG)
        return
    data = {key: source_config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if source_config.get(key) is not None}
    (folder / GENERATION_CONFIG).write_text(json.dumps(data, indent=2) + "\n")

