"""Where a recovery run continues from: the run folder's checks, the checkpoint to resume (``--resume auto`` or a
named one, read back whole), the settings it must share with the interrupted run."""

from __future__ import annotations

import json
from pathlib import Path

from mha2mla import UserError
from mha2mla.io.model_folder import CONFIG_FILE, RECOVER_CONFIG, RECOVERY_REPORT
from mha2mla.train.config import RecoverConfig
from mha2mla.train.state import checkpoint as ckpt


def flat_settings(settings: dict, prefix: str = "") -> dict:
    """Nested settings as one level, the nested names joined by ``_`` (``lora.rank`` -> ``lora_rank``, the name of
    its flag), so two runs' settings compare key by key."""
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat.update(flat_settings(value, f"{prefix}{key}_"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def changed_settings(saved_path: Path, settings: dict) -> tuple[list[str], UserError | None]:
    """The settings (named as their flags) in which ``settings`` (``RecoverConfig.outcome_fields()``) differ from
    those the run in the folder recorded in ``saved_path``, and the error to raise when that record is damaged.
    None recorded: nothing differs."""
    if not saved_path.is_file():
        return [], None
    try:
        saved = flat_settings(json.loads(saved_path.read_text()))
    except (ValueError, AttributeError, TypeError) as error:
        return [], UserError(f"{saved_path} is damaged ({type(error).__name__}); it records the run's settings: restore "
                             "it, or delete it to resume without checking that the settings are the same.")
    current = flat_settings(settings)
    return sorted(key for key in current.keys() | saved.keys() if saved.get(key) != current.get(key)), None


def check_same_run(config: RecoverConfig, folder: Path) -> None:
    """Refuse to resume the run in ``folder`` with settings that change what it computes (named as their flags)."""
    changed, damaged = changed_settings(folder / RECOVER_CONFIG, config.outcome_fields())
    if damaged is not None:
        raise damaged
    if changed:
        raise UserError(f"cannot resume: settings differ from the interrupted run ({', '.join(changed)}); use the same options.")


def restore(config: RecoverConfig, resume: str | None, settings: dict, last_step: int,
            rank: int = 0) -> tuple[Path | None, dict | None]:
    """The checkpoint a run continues from and what it holds, every file read back (None, None: a fresh run), after
    checking OUT: an existing, non-empty OUT must be a recover run folder (its settings or checkpoints) or a finished
    one, a fresh run wants it new or empty, a resumed one the same ``settings`` (``outcome_fields()``) as the run
    there. ``--resume auto`` takes the newest complete checkpoint (saying which damaged ones it passed over), a named
    one must be complete; a checkpoint past ``last_step`` counts as damaged."""
    out = config.out_path
    changed, damaged = changed_settings(out / RECOVER_CONFIG, settings)
    finished = (out / CONFIG_FILE).is_file()
    checkpoints = ckpt.list_checkpoints(out)
    used = out.is_dir() and any(out.iterdir())
    if used and not ((out / RECOVERY_REPORT).is_file() or (out / RECOVER_CONFIG).is_file() or checkpoints):
        raise UserError(f"--out {out} is not empty and was not written by mha2mla recover; choose a new or empty --out.")
    if resume is None:
        if used and finished:
            raise UserError(f"{out} already holds a recovered model; choose another --out.")
        if used and checkpoints:
            raise UserError(f"{out} holds checkpoints of an unfinished run; pass --resume auto to continue it.")
        if used:
            raise UserError(f"{out} holds an unfinished run without checkpoints; choose another --out, or pass "
                            "--resume auto to restart the run there.")
        return None, None
    if finished:  # checked before anything trains, whichever checkpoint is named
        raise UserError(f"the run in {out} has already finished; choose another --out.")
    chosen = Path(resume).expanduser() if resume != "auto" else (checkpoints[-1] if checkpoints else None)
    if resume != "auto" and (not chosen.is_dir() or not ckpt.STEP_PATTERN.match(chosen.resolve().name)):
        raise UserError(f"--resume {resume} is not a checkpoint folder (OUT/checkpoints/step-NNNNNN); use --resume auto.")
    if chosen is None:
        return None, None
    if damaged is not None:
        raise damaged
    if changed:
        raise UserError(f"cannot resume: settings differ from the interrupted run ({', '.join(changed)}); use the same options.")
    if resume == "auto":
        return ckpt.newest_complete(out, rank, last_step) or (None, None)
    try:
        return chosen, ckpt.load_checkpoint(chosen, rank, last_step)
    except ckpt.DamagedCheckpoint as error:
        raise UserError(f"{str(error).removesuffix('.')}; resume from an earlier checkpoint, or use --resume auto "
                        "to take the newest complete one.") from None
