"""Encodings on disk beyond the core's metadata: the safetensors reader and writer, Hugging
Face directories. Imports ``core`` and ``errors`` only."""
