"""Resumable checkpoints: ``OUT/checkpoints/step-NNNNNN/`` holds the trainable weights (and the peft adapter),
optimizer, scheduler, every process's RNG state (gather.py gathers them) and the trainer state (:func:`fresh_state`:
the step, the data position, the curves so far) stamped with the checkpoint format version. A checkpoint of any other
version is refused in one sentence (:func:`load_checkpoint`): a run is resumed by the mha2mla that started it. They
are the run's, not the model's: once the model is written they are removed (:func:`remove_checkpoints`) unless asked
to stay, and an interrupted run says which it keeps (:func:`interrupted_sentence`). ``checkpoints`` goes on OUT's
list of what mha2mla wrote (mha2mla/io/written.py) with the first checkpoint and off it when they are removed; only
the step folders are ever removed, never other files in it.

A checkpoint is written into a hidden staging folder next to it (mha2mla/io/output.py's names, so the next run
removes one a killed writer left), every file fsynced, then renamed to ``step-NNNNNN``: a run killed while saving
leaves the previous checkpoint complete. Before a resume every file of the checkpoint is read back
(:func:`load_checkpoint`); a damaged one is named, and ``--resume auto`` falls back to the newest complete one
(:func:`newest_complete`)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from mha2mla import UserError
from mha2mla.io.model_folder import CONFIG_FILE, RECOVER_CONFIG
from mha2mla.io.output import remove_stale, staging_path, write_errors
from mha2mla.io.staging import discard_aside, move_aside
from mha2mla.io.writer import write_safetensors
from mha2mla.io.written import forget_written, record_written

log = logging.getLogger(__name__)

STEP_PATTERN = re.compile(r"^step-(\d{6,})$")
CHECKPOINTS = "checkpoints"  # OUT's subfolder of resume checkpoints
TRAINABLE_FILE = "trainable.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
STATE_FILE = "trainer_state.json"
# the form of everything a checkpoint holds, written into its trainer state; checkpoints from before versions count
# as version 1, and every version but this one is refused
FORMAT_VERSION = 2
VERSION_KEY = "format_version"


def fresh_state() -> dict:
    """The trainer state of a run at step 0: the step, the data position (the rows consumed, and the rows' own
    ``state_dict()`` once saved), the tokens and seconds trained, the loop's wall time (the time budget's, summed over
    resumptions) and the curves so far."""
    return {"step": 0, "rows_consumed": 0, "tokens_trained": 0, "train_seconds": 0.0, "wall_seconds": 0.0,
            "losses": [], "evaluations": [], "data": None}


class DamagedCheckpoint(UserError):
    """A checkpoint folder with a missing or unreadable file (the sentence names it)."""


def step_folder(out: Path, step: int) -> Path:
    return out / CHECKPOINTS / f"step-{step:06d}"


def list_checkpoints(out: Path) -> list[Path]:
    """The checkpoint folders of the run in ``out`` (``OUT/checkpoints/step-*``, complete or damaged), oldest first."""
    folder = out / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [(int(match.group(1)), child) for child in folder.iterdir()
             if (match := STEP_PATTERN.match(child.name)) and child.is_dir()]
    return [path for _, path in sorted(found)]


def remove_checkpoints(out: Path) -> None:
    """Remove the run's checkpoints from ``out``, once the model they trained is written there; the
    checkpoints folder goes too when nothing else is in it (a file put there by hand stays, off mha2mla's list)."""
    for folder in list_checkpoints(out):
        shutil.rmtree(folder)
    if (out / CHECKPOINTS).is_dir() and not (out / CHECKPOINTS).is_symlink():
        remove_stale(out / CHECKPOINTS)  # a save a killed run left half-written
        if not any((out / CHECKPOINTS).iterdir()):
            (out / CHECKPOINTS).rmdir()
    forget_written(out, [CHECKPOINTS])


def newest_complete(out: Path, rank: int = 0, last_step: int | None = None) -> tuple[Path, dict] | None:
    """The newest checkpoint in ``out`` whose files all read back (and whose step is at most ``last_step``), with
    what it holds; each damaged one newer than it is named in a warning. None when there is no checkpoint; every
    one damaged is one sentence."""
    damaged = []
    for folder in reversed(list_checkpoints(out)):
        try:
            saved = load_checkpoint(folder, rank, last_step)
        except DamagedCheckpoint as error:
            damaged.append(str(error))
            continue
        for sentence in damaged:
            log.warning("%s; resuming from %s instead.", sentence.removesuffix("."), folder.name)
        return folder, saved
    if damaged:
        raise UserError(f"every checkpoint in {out} is damaged ({damaged[0]}); remove them (the step-* folders in "
                        f"{out / CHECKPOINTS}) to start the run again from step 0.")
    return None


class _KeepsWriteErrors:
    """The file ``torch.save`` writes through, keeping the OSError a write raised: torch turns it into a
    RuntimeError without the errno, and a full disk is to be one sentence naming it."""

    def __init__(self, handle):
        self.handle, self.error = handle, None

    def write(self, data) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def flush(self) -> None:
        self.handle.flush()


def _torch_file(obj):
    """A writer of ``obj`` with ``torch.save`` into an open file, straight from its tensors (no copy of the whole
    state in memory: an optimizer's moments are twice the trainable weights)."""
    def write(handle) -> None:
        kept = _KeepsWriteErrors(handle)
        try:
            torch.save(obj, kept)
        except RuntimeError:
            if kept.error is not None:
                raise kept.error from None
            raise
    return write


def _write_synced(path: Path, write) -> None:
    """``write`` (a function of the open file) into ``path``, then fsync it."""
    with open(path, "wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())


def _sync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _write_files(staging: Path, trainable, optimizer_state, scheduler_state, trainer_state, rng_states,
                 adapter_model) -> None:
    _write_synced(staging / TRAINABLE_FILE, lambda handle: write_safetensors(handle, trainable))  # tensor by tensor
    _write_synced(staging / OPTIMIZER_FILE, _torch_file(optimizer_state))
    _write_synced(staging / SCHEDULER_FILE, _torch_file(scheduler_state))
    for rank, state in enumerate(rng_states):
        _write_synced(staging / f"rng_state_{rank}.pt", _torch_file(state))
    if adapter_model is not None:  # the peft adapter, loadable on its own with PeftModel.from_pretrained; its
        # tensors are the ones given (gathered from every process under FSDP), not the model's own (maybe shards)
        adapter_model.save_pretrained(str(staging / "adapter"), state_dict=trainable)
    stamped = {**trainer_state, VERSION_KEY: FORMAT_VERSION}
    _write_synced(staging / STATE_FILE, lambda handle: handle.write((json.dumps(stamped, indent=2) + "\n").encode()))
    _sync_folder(staging)


def _put_in_place(staging: Path, final: Path) -> None:
    """Rename ``staging`` to ``final``; an earlier folder of that name (a damaged checkpoint) is moved aside first."""
    aside = move_aside(final) if os.path.lexists(final) else None
    os.rename(staging, final)
    _sync_folder(final.parent)
    if aside is not None:
        discard_aside(aside, final)


def save_checkpoint(
    out: Path,
    step: int,
    trainable: dict[str, torch.Tensor],
    optimizer_state: dict,
    scheduler_state: dict,
    trainer_state: dict,
    rng_states: list[dict],
    adapter_model=None,
    keep: int = 2,
) -> Path:
    """Write one checkpoint atomically (main process only) and prune all but the newest ``keep``. A full disk is one
    sentence and leaves no staging folder."""
    final = step_folder(out, step)
    with write_errors(final):
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(final.parent)
        staging = staging_path(final)
        try:
            staging.mkdir()
            _write_files(staging, trainable, optimizer_state, scheduler_state, trainer_state, rng_states,
                         adapter_model)
            _put_in_place(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            if not any(final.parent.iterdir()):  # the first save failed: no empty checkpoints folder left behind
                final.parent.rmdir()
            raise
        record_written(out, {CHECKPOINTS: None})  # on OUT's list of what mha2mla wrote (mha2mla/io/written.py)
    for old in list_checkpoints(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _first_line(error: BaseException) -> str:
    text = " ".join(str(error).split("\n")[0].split()) or type(error).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _read(folder: Path, name: str, reader):
    """``reader(path)``, or a DamagedCheckpoint naming the file when it is missing or does not read back."""
    path = folder / name
    if not path.is_file():
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {name} is missing.")
    try:
        return reader(path)
    except Exception as error:  # truncated zip, garbage bytes, a pickle payload weights_only refuses, bad JSON
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged: {name} does not read back "
                                f"({type(error).__name__}: {_first_line(error)}).") from error


def _trainer_state(path: Path, last_step: int | None = None) -> dict:
    state = json.loads(path.read_text())
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or not isinstance(state.get("rows_consumed"), int):
        raise ValueError("it does not hold the step and the data position")
    if state["step"] < 1 or state["rows_consumed"] < 0:
        raise ValueError(f"it claims step {state['step']} and {state['rows_consumed']} rows read")
    if last_step is not None and state["step"] > last_step:  # a checkpoint is never saved at or past the last step
        raise ValueError(f"it claims step {state['step']} of a {last_step}-step run")
    return state


def load_checkpoint(folder: Path, rank: int = 0, last_step: int | None = None) -> dict:
    """Everything a checkpoint holds, as tensors/dicts (weights on CPU); a missing or unreadable file, or a trainer
    state past ``last_step`` (the run's settings), is a :class:`DamagedCheckpoint` naming it, a checkpoint of another
    format version a UserError. Nothing is unpickled (``weights_only``)."""
    folder = Path(folder)
    if not (folder / f"rng_state_{rank}.pt").is_file() and (folder / "rng_state_0.pt").is_file():
        raise UserError(f"{folder} was written by a run with fewer processes; resume with the same number of processes.")

    def torch_file(path: Path):
        with warnings.catch_warnings():  # torch's note on a foreign pickle protocol would precede the one sentence
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)

    state = _read(folder, STATE_FILE, lambda path: _trainer_state(path, last_step))
    version = state.get(VERSION_KEY, 1)
    if version != FORMAT_VERSION:
        raise UserError(f"{folder} is a checkpoint of format version {version}, not {FORMAT_VERSION}: finish that run "
                        "with the mha2mla version that started it, or start it again.")
    return {
        "state": state,
        "trainable": _read(folder, TRAINABLE_FILE, lambda path: load_safetensors(path.read_bytes())),
        "optimizer": _read(folder, OPTIMIZER_FILE, torch_file),
        "scheduler": _read(folder, SCHEDULER_FILE, torch_file),
        "rng": _read(folder, f"rng_state_{rank}.pt", torch_file),
    }


def interrupted_sentence(out: Path) -> str:
    """What an interrupted run leaves in ``out`` and how to go on, as one sentence."""
    checkpoints = list_checkpoints(out)
    if checkpoints:
        return (f"interrupted; the checkpoints in {checkpoints[-1].parent} are kept: run the same command with "
                "--resume auto to continue from the newest.")
    if out.is_dir() and (out / RECOVER_CONFIG).is_file() and not (out / CONFIG_FILE).is_file():
        return (f"interrupted before the first checkpoint; {out} holds only the run's settings and log: run the same "
                "command with --resume auto to start it again, or remove it.")
    return "interrupted; the run had not written to --out yet: run the command again."
