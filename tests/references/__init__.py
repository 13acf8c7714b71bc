"""Pure-PyTorch references, one module per op, computed in fp64 and materialising everything.
The ground truth of the tests and the benchmarks; never used in training."""
