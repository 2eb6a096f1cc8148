"""Errors meshshard raises for bad input: each names the argument, the value and the fix."""

from __future__ import annotations


class MeshshardInputError(ValueError):
    """A user-facing argument or program is not something meshshard can run."""


class MeshshardRuntimeError(RuntimeError):
    """Something failed while running a plan on the cluster."""
