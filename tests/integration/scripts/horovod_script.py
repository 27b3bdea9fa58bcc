"""An unmodified Horovod script: only `import horovod.torch as hvd`, as users have them today."""

import horovod.torch as hvd
import torch

hvd.init()
tensor = hvd.allreduce(torch.ones(2) * (hvd.rank() + 1), op=hvd.Sum)
print(f"horovod rank {hvd.rank()}/{hvd.size()} sum {tensor.tolist()} module {hvd.__name__}", flush=True)
