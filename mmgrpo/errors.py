"""Exceptions the CLI turns into a one-line message and exit code 2 (user errors), and the training faults.

Maths modules raise plain ValueError; the engine raises these so the CLI can tell user errors from bugs.
"""


class UserError(ValueError):
    """Bad input from the user (config, path, data): one line saying what is wrong, why, and how to fix it."""


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (repeated NaNs, a failing reward) after saving a checkpoint.

    `checkpoint` is the directory saved on the way out; the CLI adds the exact command that resumes from it."""

    def __init__(self, message: str, checkpoint=None):
        super().__init__(message)
        self.checkpoint = checkpoint


class RewardFailed(RuntimeError):
    """A reward raised while scoring (on this or another rank); the message names the reward and the sample."""
