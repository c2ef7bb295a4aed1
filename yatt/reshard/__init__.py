"""Resharding: Megatron training layout -> inference layout, and the bucketed weight sync.

:mod:`.plan` builds copy plans from shapes, :mod:`.kernel` runs them with the ``yatt._C``
block-copy kernels (C++ threads on CPU, one launch on CUDA), :mod:`.sync` streams a trainer's
weights into an engine bucket by bucket.
"""
from yatt.reshard.kernel import run_copies
from yatt.reshard.plan import ParamSpec, Piece, copy_blocks, megatron_params, target_range
from yatt.reshard.sync import DEFAULT_BUCKET_BYTES, BucketedSync, plan_buckets

__all__ = ["BucketedSync", "DEFAULT_BUCKET_BYTES", "ParamSpec", "Piece", "copy_blocks", "megatron_params",
           "plan_buckets", "run_copies", "target_range"]
