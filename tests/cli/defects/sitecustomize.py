"""Installs a defect of ``tests.distributed.breakers`` in every Python process started with this folder on
``PYTHONPATH`` and ``PPCTL_TEST_DEFECT=<name>`` set: a broken twin for commands that start processes of their own
(``ppctl verify``'s runs and their torchrun workers), where the in-process ``broken`` cannot reach."""

import os

if os.environ.get("PPCTL_TEST_DEFECT"):
    from tests.distributed.breakers import broken

    broken(os.environ["PPCTL_TEST_DEFECT"]).__enter__()  # for the whole process: it ends with the run
