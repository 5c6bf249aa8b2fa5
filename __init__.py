"""jaxgen: a JAX/XLA compiled inference pipeline for large language models.

Jitted prefill and decode steps over a donated, preallocated KV cache, driven by a host loop
that tokenizes, schedules requests into cache slots, samples, detokenizes, streams and stops.
"""

from jaxgen.decode.outputs import CompletionOutput, RequestOutput
from jaxgen.decode.params import SamplingParams
from jaxgen.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
