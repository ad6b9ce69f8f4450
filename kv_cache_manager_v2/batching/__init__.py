"""One continuous batcher (FCFS admission, chunked prefill, preemption by suspension, resume, recompute) that
drives a ``KVCacheManager``; an engine (``BatchEngine``) computes the steps. The simulator and the model server
both run on it."""

from .batcher import ContinuousBatcher
from .engine import BatchEngine
from .interrupts import StepBoundaryInterrupts
from .options import BatchingOptions
from .request import BatchedRequest

__all__ = ["BatchEngine", "BatchedRequest", "BatchingOptions", "ContinuousBatcher", "StepBoundaryInterrupts"]
