"""Storage: byte ranges read into buffers, files written atomically. Imports ``format``,
``core`` and ``errors``."""
