"""Unit tests of paddle_dcp.format."""
