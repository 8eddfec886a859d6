"""What ``trainer.compile`` leaves outside the compiled graphs.

With ``trainer.compile`` each transformer block runs through ``torch.compile`` (``ppctl.model.compiled``). Dynamo
traces the block; a call to a function marked ``outside_graph`` ends the graph there, runs eagerly and a new graph
starts after it, so inductor compiles the regions between (norms without a weight-gradient store, activations,
rotary, the attention core, residual adds) with their backward through AOTAutograd, and the marked calls keep their
own autograd Functions:

- the B/W split's ops (``ppctl.autograd.weight_grad.split_op``): their backward asks at run time whether a B is
  deferring (a side effect on the stage's store), which a graph traced ahead of time cannot ask;
- the TP/SP and CP collectives (``ppctl.parallel``): they wait on communicator lanes and a pair's turn;
- a mixture's MLP (``ppctl.model.moe.layer.MoEMLP``): its routing counts are data (a graph of them would be
  compiled again at each new count) and its experts go through the expert exchange.

Eager code (``trainer.compile=false``) pays one ``torch.compiler.is_compiling()`` test per call and never imports
Dynamo: ``torch.compiler.disable`` would import it where it decorates (about a second added to every process that
imports the model, compiled or not). While Dynamo traces, the test is true and the call goes through torch's own
lazy ``disable`` (``torch._compile._disable_dynamo``, a module Dynamo never traces into), so the graph breaks there.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch
from torch._compile import _disable_dynamo

Function = TypeVar("Function", bound=Callable)


def outside_graph(function: Function) -> Function:
    """``function``, run eagerly with a graph break around it when compiled code calls it (module docstring)."""
    disabled = _disable_dynamo(function)

    @functools.wraps(function)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():  # only while Dynamo traces: the graph breaks at ``disabled``
            return disabled(*args, **kwargs)
        return function(*args, **kwargs)

    return call
