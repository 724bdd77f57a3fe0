"""zenflow: offload-optimizer primitives (ZenFlow). ``zenflow.torch`` is the PyTorch optimizer."""
