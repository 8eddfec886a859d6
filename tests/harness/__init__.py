"""The test harness: worker pools and spawning, the backend choice, the forkserver preload, tolerances, the model oracle."""
