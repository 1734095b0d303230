"""The runtime that executes plans on torch.distributed (with training/loop.py and checkpoints/saver.py, rng.py,
rundir.py and export.py: the only modules that import torch, as tests/planner/test_imports.py checks).

One process per GPU (gloo on CPU). A replica is (ParallelConfig, global
ranks); `build_replica_groups` makes its process groups, `StageModel` is the
part of the model one rank holds, and `train_step` runs its micro-batches
with 1F1B. See parallelism/batch.py for how documents become model input,
parallelism/context_parallel.py for micro-batches spread over CP ranks, storage/hf.py
for Hugging Face configs and weights (transformers imported only when used).
"""

from hydraulis.families import spec_from_hf_config
from hydraulis.runtime.modeling.attention import attention_backend, per_document_attention, varlen_attention
from hydraulis.runtime.modeling.cross_entropy import head_cross_entropy
from hydraulis.runtime.modeling.model import ParamLayout, StageModel, stage_layers
from hydraulis.runtime.parallelism.batch import (
    IGNORE_INDEX,
    MicroBatchInput,
    concatenate_cp_shard,
    concatenate_documents,
    count_targets,
)
from hydraulis.runtime.parallelism.context_parallel import ContextParallel
from hydraulis.runtime.parallelism.groups import ReplicaGroups, build_replica_groups, single_process_groups
from hydraulis.runtime.parallelism.tensor_parallel import ShardSpec, TensorParallel
from hydraulis.runtime.pipeline.one_f_one_b import micro_batch_loss
from hydraulis.runtime.pipeline.step import StepResult, train_step

__all__ = [
    "IGNORE_INDEX",
    "ContextParallel",
    "MicroBatchInput",
    "ParamLayout",
    "ReplicaGroups",
    "ShardSpec",
    "StageModel",
    "StepResult",
    "TensorParallel",
    "attention_backend",
    "build_replica_groups",
    "concatenate_cp_shard",
    "concatenate_documents",
    "count_targets",
    "head_cross_entropy",
    "micro_batch_loss",
    "per_document_attention",
    "single_process_groups",
    "spec_from_hf_config",
    "stage_layers",
    "train_step",
    "varlen_attention",
]
