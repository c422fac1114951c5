"""The hand-written Transformer: attention (§3.2), layers (§3.3-3.5), the full model (§3.1)."""

from tformer_cli.model.transformer import Decoded, DecoderCache, Encoded, Transformer, build_model

__all__ = ["Decoded", "DecoderCache", "Encoded", "Transformer", "build_model"]
