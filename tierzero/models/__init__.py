"""Built-in models for the CLI, tests and benchmarks."""

from tierzero.models.gpt import CONFIGS, GPT, GPTConfig, GPTOutput, build, gpt_config

__all__ = ["CONFIGS", "GPT", "GPTConfig", "GPTOutput", "build", "gpt_config"]
