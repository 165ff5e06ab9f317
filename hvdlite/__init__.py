"""hvdlite: Horovod-compatible distributed training for PyTorch and TensorFlow/Keras 3."""
__version__ = "0.1.0"
