from tests.cli.runs import single_run  # noqa: F401  (the single-process reference runs, as the CLI tests use them)
