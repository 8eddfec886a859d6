"""Imported once by the test workers' forkserver (``tests.harness.spawn.worker_context``): torch and every ppctl module.

Each worker forked from it then starts with them loaded, instead of importing them itself; one
config composition loads Hydra and OmegaConf (and Hydra's plugin scan) too, which every case's first
``compose_config`` would otherwise pay. Nothing here runs a torch op or starts a thread: a forked
worker starts as clean as a spawned one.
"""

import contextlib
import io

import torch  # noqa: F401
import torch.distributed  # noqa: F401

from tests.harness.pool import _import_ppctl

with contextlib.redirect_stdout(io.StringIO()):  # ppctl.config.__main__ prints the key table when imported
    _import_ppctl()

from ppctl.config import compose_config  # noqa: E402

compose_config(["data=synthetic"])  # leaves no Hydra instance behind (compose_config clears it)
