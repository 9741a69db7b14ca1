"""asymspec: cloud-edge speculative decoding over asymmetric links (shared protocol package)."""

__version__ = "0.1.0"
