"""Where a recovery run continues from: the run folder's checks, the checkpoint to resume (``--resume auto`` or a
named one, read back whole), the settings it must share with the interrupted run, and its metrics log up to there."""

from __future__ import annotations

import json
from pathlib import Path

from mha2mla import UserError
from mha2mla.io.model_folder import RECOVER_CONFIG, RECOVERY_REPORT
from mha2mla.train import checkpoint as ckpt
from mha2mla.train.config import LEGACY_MIXED_PRECISION, RecoverConfig, flat_settings


def _check_run_folder(out: Path) -> None:
    """An existing, non-empty --out must be a recover run folder (its settings or checkpoints) or a finished one."""
    if not out.is_dir() or not any(out.iterdir()):
        return
    if (out / RECOVERY_REPORT).is_file() or (out / RECOVER_CONFIG).is_file() or ckpt.list_checkpoints(out):
        return
    raise UserError(f"--out {out} is not empty and was not written by mha2mla recover; choose a new or empty --out.")


def resume_point(config: RecoverConfig, resume: str | None) -> Path | None:
    """The checkpoint to continue from (None: a fresh run), after checking OUT is usable. A checkpoint is only
    named here; :func:`restore_point` reads it back."""
    out = config.out_path
    _check_run_folder(out)
    finished = (out / "config.json").is_file()
    if resume is None:
        if out.exists() and any(out.iterdir()):
            if finished:
                raise UserError(f"{out} already holds a recovered model; choose another --out.")
            if ckpt.list_checkpoints(out):
                raise UserError(f"{out} holds checkpoints of an unfinished run; pass --resume auto to continue it.")
            raise UserError(f"{out} holds an unfinished run without checkpoints; choose another --out, or pass "
                            "--resume auto to restart the run there.")
        return None
    if finished:  # checked before anything trains, whichever checkpoint is named
        raise UserError(f"the run in {out} has already finished; choose another --out.")
    if resume == "auto":
        return ckpt.latest_checkpoint(out)
    path = Path(resume).expanduser()
    if not path.is_dir() or not ckpt.STEP_PATTERN.match(path.resolve().name):
        raise UserError(f"--resume {resume} is not a checkpoint folder (OUT/step-NNNNNN); use --resume auto.")
    return path


def restore_point(config: RecoverConfig, resume: str | None, rank: int = 0,
                  world: int = 1) -> tuple[Path | None, dict | None]:
    """The checkpoint a run continues from and what it holds, every file read back: ``--resume auto`` takes the
    newest complete checkpoint (saying which damaged ones it passed over), a named checkpoint must be complete. A
    checkpoint past the run's last step (``world`` processes) counts as damaged."""
    chosen = resume_point(config, resume)
    if chosen is None:
        return None, None
    last_step = config.total_steps(world)
    if resume == "auto":
        found = ckpt.newest_complete(config.out_path, rank, last_step)
        return found if found is not None else (None, None)
    try:
        return chosen, ckpt.load_checkpoint(chosen, rank, last_step)
    except ckpt.DamagedCheckpoint as error:
        raise UserError(f"{str(error).removesuffix('.')}; resume from an earlier checkpoint, or use --resume auto "
                        "to take the newest complete one.") from None


def check_same_run(config: RecoverConfig, folder: Path) -> None:
    """Refuse to resume the run in ``folder`` with settings that change what it computes (named as their flags)."""
    saved_path = folder / RECOVER_CONFIG
    if not saved_path.is_file():
        return
    try:
        saved = flat_settings(json.loads(saved_path.read_text()))
    except (ValueError, AttributeError, TypeError) as error:
        raise UserError(f"{saved_path} is damaged ({type(error).__name__}); it records the run's settings: restore it, "
                        "or delete it to resume without checking that the settings are the same.") from None
    if "mixed_precision" in saved:  # a run started before compute_dtype replaced it
        saved.setdefault("compute_dtype", LEGACY_MIXED_PRECISION.get(saved.pop("mixed_precision")))
    current = flat_settings(config.outcome_fields())
    # a setting newer than the interrupted run (e.g. generated_temperature) counts as its default there
    defaults = {name: info.default for name, info in RecoverConfig.model_fields.items() if not info.is_required()}
    changed = sorted(key for key in current if saved.get(key, defaults.get(key)) != current[key])
    if changed:
        raise UserError(f"cannot resume: settings differ from the interrupted run ({', '.join(changed)}); use the same options.")


def interrupted_sentence(out: Path) -> str:
    """What an interrupted run leaves in ``out`` and how to go on, as one sentence."""
    checkpoints = ckpt.list_checkpoints(out)
    if checkpoints:
        return (f"interrupted; the checkpoints in {checkpoints[-1].parent} are kept: run the same command with "
                "--resume auto to continue from the newest.")
    if out.is_dir() and (out / RECOVER_CONFIG).is_file() and not (out / "config.json").is_file():
        return (f"interrupted before the first checkpoint; {out} holds only the run's settings and log: run the same "
                "command with --resume auto to start it again, or remove it.")
    return "interrupted; the run had not written to --out yet: run the command again."


def logged_until(log_path: Path, step: int) -> list[str]:
    """The lines of a run's metrics log up to ``step`` (lines a kill cut short are dropped)."""
    if not log_path.is_file():
        return []
    kept = []
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line)
    return kept
