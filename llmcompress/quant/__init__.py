"""Weight quantization primitives: group-wise asymmetric uniform (RTN), bit packing, STE fake-quant, plans.

Pure tensor-in/tensor-out math lives in `primitives.py`; `plan.py` holds the `MixedPrecisionPlan`
(an ordered FQN -> `QuantConfig` map, torchao `FqnToConfig` style); `apply.py` quantizes a model by a plan.
"""

from llmcompress.quant.plan import MixedPrecisionPlan, QuantConfig

__all__ = ["MixedPrecisionPlan", "QuantConfig"]
