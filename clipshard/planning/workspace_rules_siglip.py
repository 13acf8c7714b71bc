"""Workspace rules of the siglip kernels (clipshard/planning/kernel_workspaces.py). Not written yet."""

RULES = {}
