"""An optional torch-profiler window over a worker's steps, for every rank.

`MINIVLLM_TORCH_PROFILE=DIR` profiles steps [MINIVLLM_PROFILE_START, +MINIVLLM_PROFILE_STEPS)
(default 300 and 20) and writes DIR/rank{R}.txt: the kernels and ops by device time, or by
host time with MINIVLLM_PROFILE_SORT=cpu (where a step's launch time goes).
"""

from __future__ import annotations

import os

from minivllm import envs


class StepProfiler:
    def __init__(self, rank: int) -> None:
        self.out_dir = envs.torch_profile_dir()
        self.start = envs.profile_start()
        self.stop = self.start + envs.profile_steps()
        self.rank = rank
        self.steps = 0
        self.prof = None

    def step(self) -> None:
        """Call before each step."""
        if not self.out_dir:
            return
        if self.steps == self.start:
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()
        elif self.steps == self.stop and self.prof is not None:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            by_cpu = envs.profile_by_cpu()
            sort = (
                "cuda_time_total" if torch.cuda.is_available() and not by_cpu else "cpu_time_total"
            )
            table = self.prof.key_averages().table(sort_by=sort, row_limit=40)
            os.makedirs(self.out_dir, exist_ok=True)
            path = os.path.join(self.out_dir, f"rank{self.rank}.txt")
            with open(path, "w") as f:
                f.write(f"steps {self.start}..{self.stop - 1}\n{table}\n")
            self.prof = None
        self.steps += 1
