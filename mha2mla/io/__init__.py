"""Reading source checkpoints lazily and writing sharded safetensors checkpoints."""
