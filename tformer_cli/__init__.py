"""tformer: train, evaluate and inspect encoder-decoder Transformers from the command line."""

__version__ = "0.1.0"
