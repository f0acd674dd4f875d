"""Quantized weights and activations (floor below kv/, above kernels/).

  spec.py      QuantSpec: one tensor's format, mirroring compressed-tensors' QuantizationArgs
  weight.py    QuantizedWeight: a linear weight in its canonical (backend-independent) form
  backend.py   LinearBackend protocol and the registry that picks a backend by spec, device and ISA
"""
