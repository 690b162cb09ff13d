"""Quantized weights (int8, fp8): the schemes tandem loads (scheme.py, torch-free), the
layers that run them (linear.py) and the checkpoints the tests and benchmarks make
(writer.py)."""
