"""Model weights and where they come from (the embedded default, local Hugging Face directories)."""
