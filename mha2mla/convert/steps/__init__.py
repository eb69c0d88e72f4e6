"""The per-layer conversion: the records a layer passes through, the step registry and each step's math."""
