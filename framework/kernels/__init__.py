"""kernels: see framework/__init__.py for the layer order."""
