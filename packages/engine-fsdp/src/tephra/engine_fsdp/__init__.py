"""tephra.engine_fsdp: the engine contract on Hugging Face models sharded with FSDP2."""

from tephra.engine_fsdp.engine import FSDPEngine
from tephra.engine_fsdp.model_builder import VALUE_HEAD

__all__ = ["FSDPEngine", "VALUE_HEAD"]
