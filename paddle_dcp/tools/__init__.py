"""The command line and its commands (inspect, verify, convert, the simulator). Never imported
by the runtime; only ``paddle_dcp.__main__`` reaches in here."""
