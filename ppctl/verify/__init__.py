"""``ppctl verify``: a user's layout proven equal to one process on their own machines.

``runs`` turns the user's overrides into the two launches (the layout as given, and the same run as one
process: ``parallel=single``, no schedule, the same global batch), each ``ppctl train`` as the user would
start it; ``shrink`` makes a large model's widths and vocabulary the smallest its layout allows;
``compare`` reads both run directories (``metrics.jsonl``'s exact losses and grad norms, both final
checkpoints as whole tensors) and judges each quantity by ``tolerance``, the rule the suite's equivalence
tests use. The CLI command and its table are ``ppctl.cli.app.verify`` and ``ppctl.cli.verify_report``.
"""
