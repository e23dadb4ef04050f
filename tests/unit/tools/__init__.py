"""Unit tests of paddle_dcp.tools."""
