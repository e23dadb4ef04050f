"""Unit tests of paddle_dcp.dist."""
