"""The tests, one package per layer of clipshard (ops, parallel, losses, optim, integrations, examples,
cuda_emulation) and the fp64 references beside them (tests/references). pytest puts the repository
root on sys.path, so helpers import as tests.<layer>.<module>."""
