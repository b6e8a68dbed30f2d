"""A module with an optional torch import: the import guard's own test target."""

try:
    import torch
except ImportError:
    torch = None
