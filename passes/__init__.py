"""Compiler passes: pure functions from frozen IR to frozen IR (installed as ``meshshard.passes``)."""
