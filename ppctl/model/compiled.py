"""``trainer.compile``: each transformer block of a chunk compiled with ``torch.compile`` (regional compilation).

``compile_blocks`` compiles each decoder layer of a chunk in place (``nn.Module.compile``: the parameter names stay
the same), with inductor (its C++ back end on a CPU) and static shapes (a pipeline's microbatches share one shape).
Dynamo inlines the layers' modules, so the layers of one chunk, all the same code, share their compiled graphs:
a chunk compiles once per distinct shape (and again for a forward without gradients: validation), at its first
microbatch. The embedding, final norm, output layer and loss stay eager.

Inside a block, what must stay eager is marked in its own module (``ppctl.autograd.compiled.outside_graph``): the B/W
split's ops, the TP/SP and CP collectives, a mixture's MLP. The graph breaks around them, so a zero-bubble
schedule's B and W run the split ops eagerly and the compiled regions between them (their backward compiled by
AOTAutograd) in B. Recomputation composes: ``model.recompute=full`` checkpoints runs of compiled blocks (the
recomputed forward is the compiled one), ``selective`` checkpoints the attention core inside the compiled graph.

Inductor's compiled code is kept in ``<run dir>/.cache/inductor``, which the launcher gives the workers
(``ppctl.run.launch.compile_env``), so that a restarted or requeued run, and the next run of the same shapes there,
loads it instead of compiling again.
"""

from __future__ import annotations

from torch import nn


def compile_blocks(chunk: nn.Module) -> None:
    """Compile each decoder layer of ``chunk`` (its ``layers``) in place."""
    for layer in chunk.layers.values():
        layer.compile(backend="inductor", dynamic=False)
