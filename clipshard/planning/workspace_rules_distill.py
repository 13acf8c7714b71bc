"""Workspace rules of the distill kernels (clipshard/planning/kernel_workspaces.py). Not written yet."""

RULES = {}
