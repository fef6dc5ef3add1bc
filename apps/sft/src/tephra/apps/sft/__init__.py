"""tephra.apps.sft: supervised fine-tuning app."""
