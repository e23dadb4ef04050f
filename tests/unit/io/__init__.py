"""Unit tests of paddle_dcp.io."""
