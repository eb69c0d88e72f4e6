"""What a recovery run keeps in its run folder, in one format version: the settings and metrics log (run_log.py),
the resumable checkpoints (checkpoint.py, with what every process contributes: gather.py), and where a run
continues from (resume.py)."""
