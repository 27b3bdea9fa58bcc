"""Pipeline parallelism for torch: `hvd.pipeline.Pipeline` runs a schedule of hvdplus.common.plans.pipeline_schedules
over the ranks of a process set."""

from hvdplus.torch.pipeline.pipeline import Pipeline, PipelineError

__all__ = ["Pipeline", "PipelineError"]
