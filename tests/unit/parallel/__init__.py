"""Unit tests of paddle_dcp.parallel."""
