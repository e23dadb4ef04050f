"""The layout of the traffic check, shared by scripts/traffic.py and test_scale_honesty.py."""
# (key, shape, dtype, mesh ids, spec) -- the test builds the same layout for the simulation
LAYOUT = [
    ("embed", (50, 16), "float32", [[0, 1], [2, 3]], (("S", 0), ("S", 1))),
    ("layer.w", (16, 12), "bfloat16", [[0, 1], [2, 3]], ("R", ("S", 1))),
    ("layer.b", (12,), "float32", [[0, 1], [2, 3]], ("R", "R")),
    ("head", (7, 16), "int64", [0, 1, 2, 3], (("S", 0),)),
    ("norm", (16,), "float16", [2, 3], (("S", 0),)),
]
