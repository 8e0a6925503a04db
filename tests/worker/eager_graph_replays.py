"""CUDA graphs stood in for on the CPU: a "replay" runs the captured forward eagerly over the
same static buffers, so a test checks what a replayed step computes (its padding included)
against plain eager steps. Imports are inside the function: the interpreted checks set
TRITON_INTERPRET before anything imports triton."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def eager_graph_replays(graphs: bool) -> Iterator[list[tuple[str, int]]]:
    """Within: model runners use graphs or not (`graphs`), and each replay is recorded as
    (graph name, padded size) in the yielded list; both patches undone after."""
    from minivllm.worker import cuda_graphs, model_runner

    replayed: list[tuple[str, int]] = []

    class EagerGraphs(cuda_graphs.StepGraphs):
        def capture(self, forward, sizes, pool=None, warm_up=True) -> None:  # noqa: ANN001
            self.forward, self.sizes = forward, sorted(sizes)

        def replay(self, size: int):  # noqa: ANN201
            replayed.append((self.name, size))
            return self.forward(size)

    init = model_runner.ModelRunner.__init__

    def init_with_graphs(self, *args, **kw) -> None:  # noqa: ANN001, ANN002, ANN003
        init(self, *args, **kw)
        self.use_graphs = graphs

    step_graphs = cuda_graphs.StepGraphs
    model_runner.ModelRunner.__init__, cuda_graphs.StepGraphs = init_with_graphs, EagerGraphs
    try:
        yield replayed
    finally:
        model_runner.ModelRunner.__init__, cuda_graphs.StepGraphs = init, step_graphs
