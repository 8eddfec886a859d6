"""Mixture of experts: a model part either family can use in place of a layer's dense MLP.

``shape.py`` (pure: the config validation, the memory model and the FLOP count read it) says which layers are
MoE layers and how tokens are routed (``MoEShape``); ``router.py`` scores the experts and picks each token's
top-k; ``dispatch.py`` sorts the tokens by expert, applies the capacity drop and puts the experts' outputs back;
``experts.py`` holds the experts' stacked weights (the expert dimension first) as GPT's GELU MLP or Llama's
SwiGLU; ``layer.py`` is the MoE MLP a family builds, whose router losses reach the backward through an identity
on its output; ``rules.py`` gives its parameters their ``ParameterRule``. Expert parallelism (the experts split
over ranks, tokens exchanged by all-to-all) is not here yet: every rank that holds a layer holds all its experts.
"""
