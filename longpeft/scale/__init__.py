"""Scale planning: will a recipe fit on N GPUs of M GiB, and how long will it take?"""

from .plan import GPU_PEAK_TFLOPS, ModelShape, Plan, estimate, shape_from_config, shape_of

__all__ = ["GPU_PEAK_TFLOPS", "ModelShape", "Plan", "estimate", "shape_from_config", "shape_of"]
