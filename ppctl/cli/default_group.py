"""A command group with a default command: ``ppctl submit OVERRIDES`` is ``ppctl submit train OVERRIDES``.

``ppctl submit`` took overrides long before it had a second form (``ppctl submit prepare-data``); a plain Click
group would read the first override as the name of a command. This group runs its default command unless the
first word names one of its commands (or asks for the group's help), so every earlier ``ppctl submit ...`` line
means what it meant, and each form keeps its own options and ``--help``.
"""

from __future__ import annotations

import click
from typer.core import TyperGroup


class DefaultCommandGroup(TyperGroup):
    """A Typer group whose arguments go to ``default_command`` unless they start with one of its commands' names
    (or the help option); set ``default_command`` in a subclass."""

    default_command = ""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Put the default command's name first when the arguments name no command of the group."""
        if not args or (args[0] not in self.commands and args[0] not in ctx.help_option_names):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)


class SubmitGroup(DefaultCommandGroup):
    """``ppctl submit``: ``train`` (the run as a Slurm job) unless ``prepare-data`` (the corpus as a job array)."""

    default_command = "train"
