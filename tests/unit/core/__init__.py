"""Unit tests of paddle_dcp.core."""
