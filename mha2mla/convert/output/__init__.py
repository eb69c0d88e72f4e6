"""What a conversion writes besides the tensors, and the checks every output must pass."""
