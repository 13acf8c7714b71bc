"""Workspace rules of the contrastive kernels (clipshard/planning/kernel_workspaces.py). Not written yet."""

RULES = {}
