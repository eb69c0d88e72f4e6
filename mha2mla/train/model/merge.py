"""Merge the trained weights back and write the native DeepSeek-V3 checkpoint of the recovered model.

OUT is written as every mha2mla output folder is (mha2mla/io/output.py): into a hidden sibling named with the PID,
the run folder's checkpoints and logs moved into it, then swapped in for OUT, so an error never leaves a half-written
model in OUT and never loses the run's checkpoints. The run's settings and log, which this run wrote, stay on OUT's
list of what mha2mla wrote, with whatever the run folder's own list named; anything else carried over is the user's. ``recovery_report.json`` marks the result as mha2mla's; the model
card is written by mha2mla/io/card.py, the one card writer. After FSDP the model is loaded again in one piece with
the gathered trainable values (:func:`reloaded_model`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from peft import PeftModel

from mha2mla.io.card import write_recovery_card
from mha2mla.io.model_folder import CONFIG_FILE, CONVERSION_REPORT, RECOVER_CONFIG, RECOVERY_REPORT
from mha2mla.io.output import staged_output
from mha2mla.modeling.absorbed import write_absorbed
from mha2mla.train.model.student import load_student
from mha2mla.train.model.trainable import load_trainable_state, make_trainable
from mha2mla.train.state.run_log import TRAIN_LOG


def merged_model(model):
    """A plain transformers model: the peft adapter merged into the base weights (``merge_and_unload``),
    trainable norm copies included; a model trained in full is returned as is."""
    if isinstance(model, PeftModel):
        return model.merge_and_unload()
    return model


def stored_dtype(model_folder: Path) -> torch.dtype:
    config = json.loads((Path(model_folder) / CONFIG_FILE).read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return getattr(torch, name) if isinstance(getattr(torch, name, None), torch.dtype) else torch.float32


def keep_input_config_keys(source: Path, written: Path) -> None:
    """Put back into ``written`` every top-level key of the input's config.json that ``save_pretrained`` dropped.
    transformers rebuilds config.json from its config class, which leaves out the keys mha2mla writes for engines
    beside it, such as the top-level ``rope_theta`` that readers of the pre-v5 key take (docs/design.md, "Rope
    scaling"). Without it such an engine falls back to its default theta and rotates the rope dims wrongly."""
    if not source.is_file():
        return
    before = json.loads(source.read_text(encoding="utf-8"))
    after = json.loads(written.read_text(encoding="utf-8"))
    missing = {key: value for key, value in before.items() if key not in after}
    if missing:
        written.write_text(json.dumps({**after, **missing}, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_recovered(
    model,
    tokenizer,
    source_folder: str | Path,
    out: str | Path,
    settings: dict,
    report: dict,
) -> Path:
    """Merge, write safetensors + config + tokenizer + absorbed weights + reports + card, then swap the result in for
    ``out``, keeping whatever the run already put there (checkpoints, logs)."""
    source_folder, out = Path(source_folder), Path(out)
    # OUT was checked before training (check_out_folder); the swap checks again what can change meanwhile
    with staged_output(out, carry=True, name="--out", own=(RECOVER_CONFIG, TRAIN_LOG)) as staging:
        plain = merged_model(model)
        plain = plain.to(stored_dtype(source_folder))
        plain.config.use_cache = True  # inference default in the written config
        plain.save_pretrained(str(staging))
        keep_input_config_keys(source_folder / CONFIG_FILE, staging / CONFIG_FILE)
        tokenizer.save_pretrained(str(staging))
        write_absorbed(staging, plain.state_dict(), plain.config)
        if (source_folder / CONVERSION_REPORT).is_file():
            shutil.copy2(source_folder / CONVERSION_REPORT, staging / CONVERSION_REPORT)
        (staging / RECOVERY_REPORT).write_text(json.dumps({"settings": settings, **report}, indent=2) + "\n")
        write_recovery_card(staging, source_folder, settings, report)
    return out


def reloaded_model(config, trainable: dict):
    """The trained model in one piece after FSDP (main process): the input model loaded again, made trainable as the
    run made it, with the gathered trainable values (the frozen weights never changed)."""
    model = make_trainable(load_student(config.model, config.attn_implementation), config.adapter,
                           layers=config.full_layers)
    load_trainable_state(model, trainable)
    return model
