"""mha2mla: convert MHA/GQA Hugging Face LLMs into native DeepSeek-V3 Multi-head Latent Attention."""

__version__ = "0.1.0"


class UserError(Exception):
    """A mistake in the user's input: printed as one sentence by the CLI, never as a traceback."""
